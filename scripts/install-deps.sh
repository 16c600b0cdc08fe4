#!/usr/bin/env bash
# Installs the Debian 12 packages dtrain needs, if any is missing (needs root or sudo).
#   scripts/install-deps.sh          build + test dependencies
#   scripts/install-deps.sh --all    also python3-torch (benchmark peer, golden-value scripts)
set -euo pipefail
pkgs=(g++ cmake ninja-build ccache libtorch-dev libgloo-dev libgtest-dev libopenblas0-pthread
      nlohmann-json3-dev libtomlplusplus-dev clang-14 libclang-rt-14-dev libsentencepiece-dev pkg-config
      strace util-linux libtcmalloc-minimal4 libjemalloc2)
# json: manifests, --config; toml++: --config; clang: fuzz targets; sentencepiece: dtrain-tokenize;
# strace: the checkpoint commit's fsync order (tests/examples/commit_order_test.cpp); util-linux: setpriv;
# tcmalloc, jemalloc: the workers' allocator (dtrun --allocator, docs/launch.md)
if [[ "${1:-}" == "--all" ]]; then pkgs+=(python3-torch); fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "dtrain: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# libtorch's matrix products go through libblas.so.3: make sure it is OpenBLAS, not the slow
# reference BLAS (installing libopenblas0-pthread normally selects it).
alt=libblas.so.3-x86_64-linux-gnu
best=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [[ -e "$best" ]] && [[ "$(readlink -f /etc/alternatives/$alt 2>/dev/null)" != "$best" ]]; then
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO update-alternatives --set "$alt" "$best"
fi
