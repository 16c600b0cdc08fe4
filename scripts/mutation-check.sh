#!/usr/bin/env bash
# Mutation check (issue 33): do the tests catch plausible bugs? Each tests/mutations/NN-name.patch
# plants one small bug in src/ and names, on a line "# tests: <regex>", the CTest tests of its area
# (ctest -R). This script copies the working tree (tracked and untracked-not-ignored files: your
# uncommitted changes included) into a scratch directory, configures and builds it once as
# scripts/build.sh does, then for each patch: applies it, rebuilds incrementally, runs the selected
# tests, and reverts it. A mutation is
#   CAUGHT  some selected test failed (or timed out),
#   MISSED  every selected test passed: the tests do not see this bug,
#   BROKEN  the patch does not apply, the tree does not build with it, or its regex selects nothing.
# The repository itself is never modified. Run it on a tree whose tests pass (scripts/test.sh):
# a test that fails anyway counts every mutation of its area as CAUGHT.
#
# Not part of CI: it takes a while (one full build, then per mutation a rebuild of what the patch
# touches, the relinks, and its area's tests: several minutes each on 2 cores, an hour or more in all).
#
# Usage: scripts/mutation-check.sh [--only NN]... [--keep] [--list]
#   --only NN  run mutation NN only (repeatable)
#   --keep     keep the scratch directory ${TMPDIR:-/tmp}/dtrain-mutation-check (the copy, its
#              build, one log per mutation); each run starts from a fresh copy all the same
#   --list     print the mutations and their test regexes, build and run nothing
#   --apply    only check that every patch still applies to the tree (no build; CTest runs this as
#              mutations.apply, so a patch the code has moved away from is found at once)
# Exit status: 0 when every mutation selected was CAUGHT, 1 otherwise, 2 for a bad command line.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

only=() keep=0 list=0 apply=0
while (($#)); do
  case $1 in
    --only) [[ ${2:-} =~ ^[0-9]+$ ]] || { echo "mutation-check: --only needs a number, e.g. --only 03" >&2; exit 2; }
            only+=("$(printf '%02d' "$((10#$2))")"); shift 2 ;;
    --keep) keep=1; shift ;;
    --list) list=1; shift ;;
    --apply) apply=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d; s/^# \{0,1\}//; p}' "$0"; exit 0 ;;
    *) echo "mutation-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# The mutations: every tests/mutations/NN-*.patch, or those --only names.
patches=()
for p in tests/mutations/[0-9][0-9]-*.patch; do
  [[ -e $p ]] || continue
  n=$(basename "$p"); n=${n%%-*}
  if ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" $n "* ]]; then patches+=("$p"); fi
done
((${#patches[@]})) || { echo "mutation-check: no mutation ${only[*]:-} in tests/mutations" >&2; exit 2; }

regex_of() { sed -n 's/^# tests: *//p' "$1" | head -n 1; }
name_of() { basename "$1" .patch; }

if ((list)); then
  for p in "${patches[@]}"; do
    printf '%s\n    %s\n    tests: %s\n' "$(name_of "$p")" "$(sed -n 's/^# Planted bug [0-9]*: *//p' "$p" | head -n 1)" "$(regex_of "$p")"
  done
  exit 0
fi

if ((apply)); then
  stale=0
  for p in "${patches[@]}"; do
    if ! out=$(git apply --check "$p" 2>&1 </dev/null); then
      echo "mutation-check: $(name_of "$p") no longer applies (refresh it against the code it plants in):"
      echo "$out" | sed 's/^/    /'
      stale=1
    fi
  done
  ((stale)) || echo "mutation-check: all ${#patches[@]} patches apply"
  exit "$stale"
fi

# The scratch copy. A fixed place, so that ccache finds the same paths run after run; a lock keeps
# two runs out of each other's way.
scratch=${TMPDIR:-/tmp}/dtrain-mutation-check
tree=$scratch/tree
mkdir -p "$scratch"
exec 9>"$scratch.lock"
flock -n 9 || { echo "mutation-check: another run holds $scratch.lock" >&2; exit 2; }
# shellcheck disable=SC2317  # (run by the EXIT trap)
cleanup() { if ((keep)); then echo "mutation-check: scratch kept in $scratch"; else rm -rf "$scratch"; fi; }
trap cleanup EXIT
rm -rf "$tree"
mkdir -p "$tree"
echo "mutation-check: copying the working tree to $tree"
git ls-files -z -co --exclude-standard |
  while IFS= read -r -d '' f; do if [[ -e $f || -L $f ]]; then printf '%s\0' "$f"; fi; done |
  tar --null -T - -cf - | tar -xf - -C "$tree"
git -C "$tree" init -q  # (git apply then patches paths relative to $tree wherever TMPDIR lies)

build() {  # build [log]: configure once (scripts/build.sh's options), then an incremental build
  if [[ ! -f $tree/build/CMakeCache.txt ]]; then
    cmake -S "$tree" -B "$tree/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$1" 2>&1 || return 1
  fi
  cmake --build "$tree/build" -j "$(nproc)" >>"$1" 2>&1
}

echo "mutation-check: building the unmodified copy once (log: $scratch/build.log)"
start=$SECONDS
if ! build "$scratch/build.log"; then
  tail -n 40 "$scratch/build.log"
  echo "mutation-check: the unmodified tree does not build; nothing checked" >&2
  exit 1
fi
echo "mutation-check: built in $((SECONDS - start)) s; ${#patches[@]} mutation(s) to check"

results=() failed=0
for p in "${patches[@]}"; do
  name=$(name_of "$p") re=$(regex_of "$p") log=$scratch/$(name_of "$p").log
  start=$SECONDS
  : >"$log"
  if [[ -z $re ]]; then
    verdict="BROKEN (no '# tests:' line)"
  elif ! git -C "$tree" apply "$repo/$p" >>"$log" 2>&1; then
    verdict="BROKEN (does not apply)"
  else
    echo "mutation-check: $name: building"
    if ! build "$log"; then
      verdict="BROKEN (does not build)"
    elif [[ $(ctest --test-dir "$tree/build" -N -R "$re" | grep -c 'Test *#') == 0 ]]; then
      verdict="BROKEN (no test matches '$re')"
    else
      echo "mutation-check: $name: ctest -R '$re'"
      if ctest --test-dir "$tree/build" -R "$re" --timeout 600 -j 2 --output-on-failure >>"$log" 2>&1; then
        verdict=MISSED
      else  # (by: the first failed tests, from ctest's closing list)
        verdict="CAUGHT by $(sed -n 's/^[[:space:]]*[0-9][0-9]* - \([^ ]*\) .*/\1/p' "$log" | head -n 3 | paste -sd ' ' -)"
      fi
    fi
    git -C "$tree" apply -R "$repo/$p"  # (rebuilt by the next mutation's build)
  fi
  [[ $verdict == CAUGHT* ]] || failed=1
  [[ $verdict != BROKEN* ]] || tail -n 15 "$log" | sed 's/^/    /'
  line="$name: ${verdict%% *} ($((SECONDS - start)) s)"
  [[ $verdict == *" "* ]] && line+=" ${verdict#* }"
  echo "mutation-check: $line (log: $log)"
  results+=("$line")
done

echo
echo "mutation-check: results (logs in $scratch$( ((keep)) || echo ', removed now: rerun with --keep to read them'))"
printf '  %s\n' "${results[@]}"
exit "$failed"
