#!/usr/bin/env bash
# Where a data-parallel step's time goes on one host (issue 31's efficiency target): the demo GPT of
# the issue (4 layers, d_model 256, 4 heads, seq 128, batch 4 per rank, one thread per rank), one
# rank alone against two (dtrun --standalone), each strategy; the median of each phase the metrics
# time (forward_s, backward_s: DDP's bucket all-reduces finish inside it, FSDP's gathers and
# reduce-scatters too; optimizer_s; step_time_s) after the first 5 steps, and W = 2's tokens/s over
# twice W = 1's. Needs build/bin.
#   bash bench/phase_profile.sh [STEPS=30] [STRATEGIES="ddp fsdp"]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/build/bin
steps=${1:-30}
strategies=${2:-ddp fsdp}
out=$(mktemp -d /tmp/dtrain-phase-profile-XXXX)
model=(--layers 4 --d-model 256 --heads 4 --seq-len 128 --batch-size 4 --threads 1 --steps "$steps")
for s in $strategies; do
  "$bin/dtrain-gpt" --strategy "$s" "${model[@]}" --metrics "$out/$s-w1.jsonl" >"$out/$s-w1.txt" 2>&1 ||
    { cat "$out/$s-w1.txt"; exit 1; }
  "$bin/dtrun" --standalone --nproc-per-node 2 "$bin/dtrain-gpt" --strategy "$s" "${model[@]}" \
    --metrics "$out/$s-w2.jsonl" >"$out/$s-w2.txt" 2>&1 || { cat "$out/$s-w2.txt"; exit 1; }
done
/usr/bin/python3 - "$out" $strategies <<'PY'
import json, statistics, sys
out, strategies = sys.argv[1], sys.argv[2:]
def med(path, key):
    rs = [r for r in (json.loads(l) for l in open(path)) if "step" in r and "loss" in r][5:]
    return statistics.median(r[key] for r in rs)
print("| strategy | W | forward s | backward s | optimizer s | step s | tokens/s | of twice W = 1 |")
print("|---|---|---|---|---|---|---|---|")
for s in strategies:
    one = med(f"{out}/{s}-w1.jsonl", "tokens_per_s")
    for w in (1, 2):
        p = f"{out}/{s}-w{w}.jsonl"
        tps = med(p, "tokens_per_s")
        ratio = f"{tps / (2 * one):.2f}" if w == 2 else ""
        print(f"| {s} | {w} | {med(p, 'forward_s'):.3f} | {med(p, 'backward_s'):.3f} | {med(p, 'optimizer_s'):.4f} | "
              f"{med(p, 'step_time_s'):.3f} | {tps:.0f} | {ratio} |")
print(f"(files: {out})")
PY
