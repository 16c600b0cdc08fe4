#!/usr/bin/env bash
# Builds dtrain against Debian sid's libtorch 2.x (CPU, Gloo; 2.14.1 on 2026-11-22) and runs every
# test, inside a sid root made with debootstrap (a developer's check, not in CI; needs root and
# Debian's archive; about 15 minutes on 2 cores). The tree tested is this checkout's HEAD.
#   scripts/test-libtorch-sid.sh [ROOT]        ROOT defaults to /tmp/dtrain-sid (kept for reruns)
#   scripts/test-libtorch-sid.sh ROOT -R regex  extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/tmp/dtrain-sid}
shift || true
ctest_args=$(printf ' %q' "$@")
apt_opts="-o Acquire::Check-Valid-Until=false -q"
if [[ ! -x $root/usr/bin/apt-get ]]; then
  command -v debootstrap >/dev/null ||
    { echo "test-libtorch-sid: needs debootstrap (apt-get install debootstrap)" >&2; exit 2; }
  debootstrap --variant=minbase --include=ca-certificates sid "$root" http://deb.debian.org/debian
fi
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
mountpoint -q "$root/dev/pts" || mount --bind /dev/pts "$root/dev/pts"
cp /etc/resolv.conf "$root/etc/"
chroot "$root" bash -c "apt-get $apt_opts update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get $apt_opts install -y \
  --no-install-recommends g++ cmake ninja-build libtorch-dev libgloo-dev libgtest-dev nlohmann-json3-dev libtomlplusplus-dev \
  libsentencepiece-dev libabsl-dev pkg-config libtcmalloc-minimal4 \
  libopenblas0-pthread ccache procps >/dev/null"
rm -rf "$root/src/dtrain"
mkdir -p "$root/src"
git clone -q . "$root/src/dtrain"
chroot "$root" bash -c "cd /src/dtrain && CCACHE_DIR=/root/.ccache scripts/build.sh >/dev/null && \
  ctest --test-dir build --output-on-failure -j 2 --timeout 600$ctest_args"
