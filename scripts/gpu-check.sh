#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent GPU machine (PyTorch 2.x with CUDA
# installed there, no network, no GoogleTest): builds dtrain against that PyTorch's libtorch
# (CUDA, NCCL compiled in) and runs the CUDA tests first, then, with --all, every other test;
# with --bench, the GPU benchmark against PyTorch (bench/gpu_bench.py) instead of tests.
#
#   here, once:  scripts/gpu-check.sh --pack
#                copies Debian's GoogleTest sources (/usr/src/googletest), nlohmann/json and toml++ headers
#                and Gloo's headers (libgloo-dev: pip and pytorch.org libtorch ship none) into
#                .gpu-deps/ (ignored by git; about 6 MB)
#   there:       bash scripts/gpu-check.sh [--all | --bench [gpu_bench.py flags]] [ctest -R regex]
#                with .gpu-deps carried along; logs land in $OUT when set (the device tool's
#                folder that comes back), else in build-gpu/logs.
#   or:          bash scripts/gpu-check.sh --session SECONDS
#                everything a lent machine's one call should do, inside SECONDS: build, the CUDA
#                tests beside the rest of the suite (both stopped at a share of the time left), then
#                the benchmark (151M and 805M, one repeat, kernel profiles side by side) in what remains.
# The default regex picks the tests that skip without CUDA and their CPU neighbours (the areas run
# as one CTest test each hold the GradScaler's and recomputation's CUDA tests).
set -euo pipefail
cd "$(dirname "$0")/.."
deps=$PWD/.gpu-deps

if [[ ${1:-} == --pack ]]; then
  [[ -d /usr/src/googletest && -d /usr/include/nlohmann && -d /usr/include/gloo && -d /usr/include/toml++ ]] ||
    { echo "gpu-check --pack: needs libgtest-dev, nlohmann-json3-dev, libtomlplusplus-dev and libgloo-dev (scripts/install-deps.sh)" >&2; exit 2; }
  rm -rf "$deps"
  mkdir -p "$deps/include" "$deps/gloo-include"
  cp -r /usr/src/googletest "$deps/googletest"
  cp -r /usr/include/nlohmann "$deps/include/"
  cp -r /usr/include/toml++ "$deps/include/"
  cp -r /usr/include/gloo "$deps/gloo-include/"
  echo "packed $(du -sh "$deps" | cut -f1) into .gpu-deps/: carry it (the device tool's carry: [\".gpu-deps\"])"
  exit 0
fi

all=no
bench=no
session=0
bench_args=()
if [[ ${1:-} == --session ]]; then session=${2:?--session SECONDS}; shift 2; fi
if [[ ${1:-} == --all ]]; then all=yes; shift; fi
if [[ ${1:-} == --bench ]]; then bench=yes; shift; bench_args=("$@"); set --; fi
regex=${1:-'Cuda|GptDevice|amp\.all|recompute\.all'}
logs=${OUT:-$PWD/build-gpu/logs}
mkdir -p "$logs"
[[ -d $deps/googletest ]] || { echo "gpu-check: no .gpu-deps/ (run scripts/gpu-check.sh --pack here and carry it)" >&2; exit 2; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$logs/machine.txt"
prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')

set -o pipefail
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DDTRAIN_GTEST_SOURCE_DIR="$deps/googletest" -DCMAKE_CXX_FLAGS="-isystem $deps/include" \
  $( [[ -d /usr/include/gloo || ! -d $deps/gloo-include ]] || echo "-DDTRAIN_GLOO_INCLUDE=$deps/gloo-include" ) \
  2>&1 | tee "$logs/configure.log"
grep -q "dtrain: libtorch .*NCCL ON" "$logs/configure.log" ||
  echo "gpu-check: NCCL was not compiled in (libtorch without CUDA?)" | tee -a "$logs/configure.log"
# (-k 0: every unit that fails to compile is in the log, not only the first)
cmake --build build-gpu -j "$(nproc)" -- -k 0 >"$logs/build.log" 2>&1 ||
  { grep -E -A3 "error:" "$logs/build.log" | head -n 80; exit 1; }
echo "built"

# --session: the CUDA tests (4 at a time: one GPU, many processes) beside the rest of the suite,
# stopped by CTest at 45% of the time left; then the benchmark alone on the machine.
if (( session > 0 )); then
  left=$(( session - SECONDS ))
  stop=$(date -d "@$(( $(date +%s) + left * 45 / 100 ))" +%H:%M:%S)
  echo "built at ${SECONDS}s of ${session}s; tests until $stop"
  ctest --test-dir build-gpu -R "$regex" -V --timeout 240 -j 4 --stop-time "$stop" >"$logs/ctest-cuda.log" 2>&1 &
  cuda_pid=$!
  ctest --test-dir build-gpu -E "$regex" --output-on-failure --timeout 240 -j 10 --stop-time "$stop" \
    >"$logs/ctest-rest.log" 2>&1 || true
  wait "$cuda_pid" || true
  pkill -f 'bin/dtrain-|bin/dtrun' || true
  grep -E "^[0-9]+: \[ +(FAILED|OK|SKIPPED) +\]" "$logs/ctest-cuda.log" || true
  tail -n 8 "$logs/ctest-cuda.log"
  grep -E "Failed|Not Run|tests passed|Timeout" "$logs/ctest-rest.log" | tail -n 30 || true
  left=$(( session - SECONDS - 10 ))
  echo "benchmark from ${SECONDS}s, ${left}s left"
  (( left > 60 )) || exit 1
  timeout "$left" python3 bench/gpu_bench.py --shapes 151m,805m --steps 20 --warmup 5 --repeats 1 --profile \
    --out "$logs/gpu_bench.json" 2>&1 | tee "$logs/gpu_bench.txt" || true
  echo "done at ${SECONDS}s"
  exit 0
fi

if [[ $bench == yes ]]; then
  python3 bench/gpu_bench.py --out "$logs/gpu_bench.json" "${bench_args[@]}" 2>&1 | tee "$logs/gpu_bench.txt"
  exit "${PIPESTATUS[0]}"
fi

status=0
# (-V: the tests' own lines, e.g. the memory planner's predicted and measured peaks, land in the log)
ctest --test-dir build-gpu -R "$regex" -V --timeout 300 -j 1 >"$logs/ctest-cuda.log" 2>&1 || status=1
grep -E "^[0-9]+: (dtrain-gpt W=|\[ +(FAILED|OK|SKIPPED) +\])" "$logs/ctest-cuda.log" || true
tail -n 12 "$logs/ctest-cuda.log"
if [[ $all == yes ]]; then
  ctest --test-dir build-gpu -E "$regex" --output-on-failure --timeout 300 -j "$(( $(nproc) * 3 / 4 ))" 2>&1 |
    tee "$logs/ctest-rest.log" | tail -n 40 || status=1
fi
exit $status
