#!/usr/bin/env bash
# System packages Baton's build and tests need, installed idempotently (Debian/Ubuntu):
#   protobuf-compiler  `protoc`, which etcd-client's build script needs (baton-cluster)
#   libprotobuf-dev    the well-known .proto files (google/protobuf/*.proto) protoc imports
#   etcd-server        the `etcd` binary the etcd membership tests start on a loopback port
#   chromium           a headless browser: the conductor's status page is tested in it
#                      (crates/baton/tests/cluster.rs, through scripts/lib/headless.py)
#   fonts-dejavu-core  a font for that browser to draw the page's text with
#   kubernetes-client  `kubectl`, whose `kustomize` renders deploy/k8s for crates/baton/tests/deploy.rs
#                      (left out where a kubectl is already on PATH, from another package)
# Nothing is done when every package is already installed; `apt-get update` runs only when
# something is missing. Runs as root, or through sudo when that is available.
set -euo pipefail

packages=(protobuf-compiler libprotobuf-dev etcd-server chromium fonts-dejavu-core)
if ! command -v kubectl >/dev/null 2>&1; then
    packages+=(kubernetes-client)
fi

missing=()
for pkg in "${packages[@]}"; do
    if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        echo "install-deps: $pkg already installed"
    else
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-deps: nothing to do"
    exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
        exit 1
    fi
fi

echo "install-deps: apt-get update (missing: ${missing[*]})"
"${sudo[@]}" apt-get update
echo "install-deps: apt-get install -y ${missing[*]}"
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y --no-install-recommends "${missing[@]}"

# etcd-server's package may start a system etcd on port 2379; the tests start their own on
# free ports, so a system one is harmless, but say where the binary is.
echo "install-deps: protoc at $(command -v protoc), etcd at $(command -v etcd || echo '(not on PATH)'), chromium at $(command -v chromium || echo '(not on PATH)')"
