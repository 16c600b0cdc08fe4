#!/usr/bin/env bash
# Compiles every dtrain source (library, demo, tools, tests, benchmarks) against the headers of
# libtorch versions this machine does not have installed, to catch 1.13-vs-2.x breakage without a
# 2.x install or a GPU (a developer's check; CI builds against Debian 12's 1.13 only):
#   - 2.14 (Debian sid's libtorch-dev): C++20, autograd nodes as intrusive_ptr;
#   - 2.6 (Debian trixie's libtorch-cuda-dev, the CUDA build's headers).
# Both with USE_C10D_NCCL and DTRAIN_WITH_NCCL, so the NCCL paths are compiled too (CUDA and NCCL
# headers from /usr/local/cuda, or CUDA_HOME; 2.14's CPU package lacks one generated CUDA header,
# c10/cuda/impl/cuda_cmake_macros.h, which a one-line stand-in provides).
# Only headers are used (g++ -fsyntax-only): nothing is linked or run. The .deb files come from
# Debian's archive through apt with a private package list (the system's apt sources are not
# touched) and are unpacked under build/libtorch-versions/.
#   scripts/check-libtorch-versions.sh            both versions, every source
#   scripts/check-libtorch-versions.sh src/comm   only sources whose path contains one of the words
# Needs a configured build/ (scripts/build.sh) for the compile commands.
set -euo pipefail
cd "$(dirname "$0")/.."
top=$PWD
work=$top/build/libtorch-versions
cuda=${CUDA_HOME:-/usr/local/cuda}
[[ -f build/build.ninja ]] || { echo "check-libtorch-versions: run scripts/build.sh first (needs build/build.ninja)" >&2; exit 2; }

mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/deb"
cat >"$work/sources.list" <<'EOF'
deb http://deb.debian.org/debian trixie main contrib
deb http://deb.debian.org/debian sid main contrib
EOF
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Sandbox::User=root)
if [[ -z "$(ls "$work/lists" 2>/dev/null | grep -v partial)" ]]; then
  apt-get "${apt_opts[@]}" update -q >/dev/null
fi

# name  package  suite-pattern  C++ standard  nccl?
versions=(
  "2.14 libtorch-dev sid gnu++20 yes"
  "2.6 libtorch-cuda-dev trixie gnu++17 yes"
)
ninja -C build -t compdb >"$work/compdb.json"
status=0
for v in "${versions[@]}"; do
  read -r name pkg suite std nccl <<<"$v"
  root=$work/$name
  if [[ ! -d $root/usr/include ]]; then
    ver=$(apt-cache "${apt_opts[@]}" madison "$pkg" | awk -v s="$suite" '$0 ~ s {print $3; exit}')
    [[ -n $ver ]] || { echo "check-libtorch-versions: no $pkg in Debian $suite" >&2; exit 2; }
    (cd "$work/deb" && apt-get "${apt_opts[@]}" download -q "$pkg=$ver" >/dev/null)
    mkdir -p "$root"
    dpkg -x "$work/deb/${pkg}_${ver//:/%3a}_amd64.deb" "$root"
  fi
  version=$(cat "$root"/usr/include/torch/{headeronly,csrc/api/include/torch}/version.h 2>/dev/null |
            sed -n 's/^#define TORCH_VERSION_\(MAJOR\|MINOR\) //p' | head -2 | paste -sd. || true)
  echo "== libtorch $version ($pkg from Debian $suite), -std=$std, NCCL: $nccl"
  if [[ $nccl == yes && ! -f $cuda/include/nccl.h ]]; then
    echo "   skipped: no CUDA/NCCL headers at $cuda (set CUDA_HOME)"
    continue
  fi
  if [[ ! -f $root/usr/include/c10/cuda/impl/cuda_cmake_macros.h ]]; then
    mkdir -p "$root/usr/include/c10/cuda/impl"
    echo '#define C10_CUDA_BUILD_SHARED_LIBS' >"$root/usr/include/c10/cuda/impl/cuda_cmake_macros.h"
  fi
  python3 - "$work/compdb.json" "$root" "$std" "$nccl" "$cuda" "$@" <<'EOF' || status=1
import concurrent.futures as cf, json, os, shlex, subprocess, sys
compdb, root, std, nccl, cuda = sys.argv[1:6]
only = sys.argv[6:]
entries = [e for e in json.load(open(compdb)) if e["file"].endswith(".cpp")]
entries = [e for e in entries if not only or any(o in e["file"] for o in only)]

def command(e):
    # The build's own command with Debian 1.13's include dirs, the precompiled header, the
    # standard and the outputs taken out, and this version's headers put first.
    args, out, skip = shlex.split(e["command"]), [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-include", "-MT", "-MF", "-o", "-isystem"):
            skip = True
        elif not (a in ("-MD", "-c", "-Winvalid-pch") or a.startswith("-std=") or a.endswith("ccache")):
            out.append(a)
    src = out.pop()
    inc = ["-isystem", root + "/usr/include", "-isystem", root + "/usr/include/torch/csrc/api/include"]
    if nccl == "yes":
        inc += ["-isystem", cuda + "/include", "-DUSE_C10D_NCCL", "-DDTRAIN_WITH_NCCL=1", "-DDTRAIN_WITH_CUDA=1", "-DUSE_CUDA"]
    return out[:1] + ["-std=" + std, "-fsyntax-only"] + inc + out[1:] + [src]

def check(e):
    r = subprocess.run(command(e), cwd=e["directory"], capture_output=True, text=True)
    return os.path.relpath(e["file"]), r.returncode, r.stderr

failed = 0
with cf.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
    for path, rc, err in pool.map(check, entries):
        if rc:
            failed += 1
            print("   FAIL " + path)
            print("\n".join(["     " + l for l in err.splitlines() if "error" in l][:10]))
print(f"   {len(entries) - failed} compiled, {failed} failed")
sys.exit(1 if failed else 0)
EOF
done
exit $status
