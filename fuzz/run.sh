#!/usr/bin/env bash
# Builds one of dtrain's libFuzzer targets with clang (ASan + UBSan) and runs it from the seed
# corpus in fuzz/corpus/<target>/.
#   fuzz/run.sh WORK_DIR TARGET [RUNS] [extra libFuzzer flags...]
#   TARGET: safetensors_header | manifest        RUNS: -runs (default 20000; -1 = until stopped)
# e.g. a long session: fuzz/run.sh /tmp/fuzz manifest -1 -max_total_time=3600 -jobs=2
# Exits 77 (skip) when clang++ or its fuzzer runtime (Debian: clang-14, libclang-rt-14-dev) is missing.
set -euo pipefail
work=${1:?work dir}; target=${2:?target}; runs=${3:-20000}; shift $(( $# < 3 ? $# : 3 ))
src=$(cd "$(dirname "$0")/.." && pwd)
case "$target" in safetensors_header|manifest) ;; *) echo "unknown target $target"; exit 2;; esac

cxx=""
for c in clang++-14 clang++; do if command -v "$c" >/dev/null; then cxx=$c; break; fi; done
if [[ -z "$cxx" ]]; then echo "SKIP: no clang++ (apt-get install clang-14)"; exit 77; fi
mkdir -p "$work"
probe="$work/probe"
if [[ ! -x "$probe" ]]; then
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$work/probe.cpp"
  if ! "$cxx" -fsanitize=fuzzer,address,undefined "$work/probe.cpp" -o "$probe" 2>"$work/probe.log"; then
    echo "SKIP: $cxx cannot link a fuzzer (apt-get install libclang-rt-14-dev):"; cat "$work/probe.log"; exit 77
  fi
fi
launcher=""
if command -v ccache >/dev/null; then launcher=ccache; fi
# DTRAIN_FUZZ_OPT: the optimisation level (-O0 by default: the sanitizers see the same code, and the
# build that CTest's bounded runs wait for takes a third of -O1's; -O1 for a long session's speed).
flags=(-std=c++17 "${DTRAIN_FUZZ_OPT:--O0}" -gline-tables-only -fsanitize=address,undefined -fno-sanitize-recover=undefined -I"$src/include")

# One build at a time per work dir (CTest may run both targets at once). Compiling from $src
# keeps ccache hits independent of the caller's directory (-g records it).
cd "$src"
exec 9>"$work/.lock"
flock 9
# The library's parsers as one translation unit (they share nlohmann/json, parsed once), rebuilt when
# a source, a header or the flags changed.
o="$work/checkpoint_parsers.o"
unit="$work/checkpoint_parsers.cpp"
printf '#include "%s"\n' "$src"/src/checkpoint/{json_fields,safetensors,manifest,sha256}.cpp >"$unit.new"
echo "// ${flags[*]}" >>"$unit.new"
if cmp -s "$unit.new" "$unit"; then rm "$unit.new"; else mv "$unit.new" "$unit"; fi
if [[ ! -f "$o" || "$unit" -nt "$o" || -n "$(find "$src/include/dtrain/checkpoint" "$src/src/checkpoint" -newer "$o" -print -quit)" ]]; then
  $launcher "$cxx" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$unit" -o "$o"
fi
objs=("$o")
bin="$work/${target}_fuzz"
if [[ ! -x "$bin" || "$src/fuzz/${target}_fuzz.cpp" -nt "$bin" || -n "$(find "${objs[@]}" -newer "$bin" -print -quit)" ]]; then
  $launcher "$cxx" "${flags[@]}" -fsanitize=fuzzer -c "$src/fuzz/${target}_fuzz.cpp" -o "$work/${target}_fuzz.o"
  "$cxx" "${flags[@]}" -fsanitize=fuzzer "$work/${target}_fuzz.o" "${objs[@]}" -o "$bin"
fi
flock -u 9

# Seeds are copied: the source tree's corpus stays as committed.
corpus="$work/corpus-$target"
rm -rf "$corpus"; mkdir -p "$corpus"
cp "$src/fuzz/corpus/$target/"* "$corpus/"
cd "$work"
exec "$bin" "$corpus" -runs="$runs" -seed=1 -max_len=4096 -dict="$src/fuzz/json.dict" -print_final_stats=1 "$@"
