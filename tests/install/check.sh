#!/usr/bin/env bash
# Installs the build into a temporary prefix and builds + runs tests/install/consumer against it
# with find_package(dtrain). Usage: check.sh <build dir> <source dir>
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
# The installed config names the libtorch dtrain was built with (a pip/pytorch.org libtorch lies on
# no default search path, so a consumer that does not name one must still find it).
torch_dir=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$build/CMakeCache.txt")
config=$(find "$tmp/prefix" -name dtrainConfig.cmake | head -1)
grep -qF "set(DTRAIN_BUILT_WITH_TORCH_DIR \"$torch_dir\")" "$config" ||
  { echo "install check: $config does not name Torch_DIR $torch_dir"; exit 1; }
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# (no optimisation: the check is that it finds, compiles against and links the installed dtrain;
# -O2 of two programs against libtorch's headers cost ~15 s of the suite)
cmake -S "$src/tests/install/consumer" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE= \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" "${launcher[@]}" >/dev/null
cmake --build "$tmp/build" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib:${LD_LIBRARY_PATH:-}" "$tmp/build/consumer"
# docs/train.md's program under the installed dtrun: FSDP with recomputation at W=2, then a resume.
export LD_LIBRARY_PATH="$tmp/prefix/lib:${LD_LIBRARY_PATH:-}"
"$tmp/prefix/bin/dtrun" --standalone --nproc-per-node 2 "$tmp/build/trainer" --strategy fsdp \
  --activation-checkpointing --steps 4 --batch-size 8 --threads 1 --save "$tmp/ck" --metrics "$tmp/m.jsonl" >"$tmp/out.txt" 2>&1 ||
  { cat "$tmp/out.txt"; exit 1; }
"$tmp/build/trainer" --strategy ddp --steps 6 --batch-size 16 --threads 1 --resume "$tmp/ck" >"$tmp/out2.txt" 2>&1 ||
  { cat "$tmp/out2.txt"; exit 1; }
grep -q "my_trainer: resumed from $tmp/ck/step-00000004: step 4" "$tmp/out2.txt" || { cat "$tmp/out2.txt"; exit 1; }
grep -q "my_trainer: done: 6 steps" "$tmp/out2.txt" && echo "trainer ok: fsdp W=2 saved, ddp W=1 resumed"
