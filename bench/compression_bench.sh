#!/usr/bin/env bash
# Gradient compression over a slow link (issue 31; Design note [gradient compression] in
# include/dtrain/ddp/comm_hook.h). Two "machines" on this one: network namespaces joined by a veth
# pair whose ends are limited to RATE with `tc qdisc ... tbf` (only the addresses made here: 10.77.N.1
# and .2), one rank on each, DDP on a GPT (4 layers, d_model 256: 3.4M parameters, 13 MB of
# gradients a step) with each --grad-compression setting, one after another:
#   - on the limited link, STEPS steps each: the step time and the MiB a step sent (comm_mib_sent,
#     rank 0's; with one rank a machine, all of it crosses the link), against fp32's;
#   - on loopback without a limit (dtrun --standalone, 2 ranks), the same steps: what each setting
#     costs or gains where bytes are cheap, and fp32's communication share on the link;
#   - on loopback, LOSS_STEPS steps: the loss curves (each setting's mean loss over the last 10 steps
#     against fp32's).
# With STRATEGY fsdp the same for FSDP's quantized collectives (Design notes [block quantization],
# [fp8 blocks], include/dtrain/comm/quantized.h) and secondary shards ([secondary shards],
# include/dtrain/fsdp/secondary_shard.h): none, --gather-quant int8, --reduce-quant int8, both,
# fp8 gathers with int8 reductions, --secondary-shard node, and both int8 with it (ZeRO++'s three).
# SETTINGS="none hpz ..." runs those only (none first: the reference); with STRATEGY ddp, "hier" is
# --hierarchical-all-reduce (Design note [two-level all-reduce], include/dtrain/comm/two_level.h),
# "hier-bf16" / "hier-fp16" the same with that compression in both levels (ddp/comm_hook.h).
# Needs root (network namespaces) and build/bin. Cleans up its namespaces.
#   sudo bash bench/compression_bench.sh [RATE=100mbit] [STEPS=12] [LOSS_STEPS=200] [STRATEGY=ddp|fsdp]
# NPROC=N puts N ranks in each namespace ("node"; 2N on loopback), MODEL="..." replaces the model's
# flags; LOSS_STEPS 0 skips the loss runs. The table's "across" column is what all ranks sent to
# the other node a step (comm_mib_across_nodes), "MiB a step" rank 0's bytes.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/build/bin
rate=${1:-100mbit}
steps=${2:-12}
loss_steps=${3:-200}
strategy=${4:-ddp}
case $strategy in
  ddp) settings=(none bf16 fp16 powersgd:4:2) ;;
  fsdp) settings=(none gather-int8 reduce-int8 both-int8 fp8-int8 hpz zeropp) ;;
  *) echo "compression_bench: STRATEGY is ddp or fsdp, not '$strategy'" >&2; exit 2 ;;
esac
flags_of() {  # a setting's dtrain-gpt flags
  case $strategy:$1 in
    ddp:hier) echo "--hierarchical-all-reduce" ;;
    ddp:hier-bf16) echo "--hierarchical-all-reduce --grad-compression bf16" ;;
    ddp:hier-fp16) echo "--hierarchical-all-reduce --grad-compression fp16" ;;
    ddp:*) echo "--grad-compression $1" ;;
    fsdp:none) echo "" ;;
    fsdp:gather-int8) echo "--gather-quant int8" ;;
    fsdp:reduce-int8) echo "--reduce-quant int8" ;;
    fsdp:both-int8) echo "--gather-quant int8 --reduce-quant int8" ;;
    fsdp:fp8-int8) echo "--gather-quant fp8 --reduce-quant int8" ;;
    fsdp:hpz) echo "--secondary-shard node" ;;
    fsdp:zeropp) echo "--gather-quant int8 --reduce-quant int8 --secondary-shard node" ;;
  esac
}
[[ -n ${SETTINGS:-} ]] && read -r -a settings <<<"$SETTINGS"
[[ ${settings[0]} == none ]] || { echo "compression_bench: SETTINGS must start with none (the reference)" >&2; exit 2; }
out=$(mktemp -d /tmp/dtrain-compression-bench-XXXX)
source "$root/tests/launch/scripts/netns_pair.sh" cb
trap netns_pair_cleanup EXIT
for end in "$a $va" "$b $vb"; do
  set -- $end
  ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst 64kb latency 200ms ||
    { echo "compression_bench: tc tbf is not available here"; exit 1; }
done
nproc=${NPROC:-1}
model_flags=${MODEL:---layers 4 --d-model 256 --heads 4 --seq-len 64 --batch-size 4}
model=(--strategy "$strategy" $model_flags --threads 1 --lr 1e-3)
port=$((29600 + net))
for c in "${settings[@]}"; do
  name=${c//:/_}
  common=(--nnodes 2 --nproc-per-node "$nproc" --master-addr "10.77.$net.1" --master-port "$port" --rdzv-timeout 60)
  ip netns exec "$a" "$bin/dtrun" "${common[@]}" --node-rank 0 "$bin/dtrain-gpt" "${model[@]}" --steps "$steps" \
    $(flags_of "$c") --metrics "$out/link-$name.jsonl" >"$out/link-$name-0.txt" 2>&1 &
  p0=$!
  ip netns exec "$b" "$bin/dtrun" "${common[@]}" --node-rank 1 "$bin/dtrain-gpt" "${model[@]}" --steps "$steps" \
    $(flags_of "$c") >"$out/link-$name-1.txt" 2>&1 ||
    { cat "$out/link-$name-1.txt"; echo "compression_bench: node 1 failed ($c)"; exit 1; }
  wait $p0 || { cat "$out/link-$name-0.txt"; echo "compression_bench: node 0 failed ($c)"; exit 1; }
  port=$((port + 1))
  for n in "$steps" "$loss_steps"; do
    ((n > 0)) || continue
    "$bin/dtrun" --standalone --nproc-per-node $((2 * nproc)) "$bin/dtrain-gpt" "${model[@]}" --steps "$n" $(flags_of "$c") \
      --metrics "$out/loop$n-$name.jsonl" >"$out/loop$n-$name.txt" 2>&1 ||
      { cat "$out/loop$n-$name.txt"; echo "compression_bench: the loopback run failed ($c)"; exit 1; }
  done
done
/usr/bin/python3 - "$out" "$rate" "$steps" "$loss_steps" "$strategy" "$nproc" "$model_flags" "${settings[@]}" <<'EOF'
import json, statistics, sys
out, rate, steps, loss_steps, strategy, nproc, model, settings = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                                  sys.argv[5], int(sys.argv[6]), sys.argv[7], sys.argv[8:])
def records(path):
    return [r for r in (json.loads(l) for l in open(path)) if "loss" in r and "step" in r]
def med(rs, key, skip=3):
    return statistics.median(r[key] for r in rs[skip:])
rows = {}
for c in settings:
    n = c.replace(":", "_")
    link, loop = records(f"{out}/link-{n}.jsonl"), records(f"{out}/loop{steps}-{n}.jsonl")
    curve = records(f"{out}/loop{loss_steps}-{n}.jsonl") if loss_steps > 0 else []
    rows[c] = dict(link_s=med(link, "step_time_s"), mib=med(link, "comm_mib_sent"), loop_s=med(loop, "step_time_s"),
                   across=med(link, "comm_mib_across_nodes") if "comm_mib_across_nodes" in link[-1] else None,
                   loss=statistics.mean(r["loss"] for r in curve[-10:]) if curve else None)
f = rows["none"]
print(f"link {rate} each way between two network namespaces, {nproc} rank(s) each; {strategy.upper()}, GPT {model}")
print(f"fp32: {f['link_s']:.3f} s a step on the link, {f['loop_s']:.3f} s on loopback: communication is "
      f"{100 * (1 - f['loop_s'] / f['link_s']):.0f}% of the step on the link")
print(f"| {'--grad-compression' if strategy == 'ddp' else 'quantized'} | MiB a step | bytes vs fp32 | MiB across | vs fp32 | "
      f"step on the link | speed-up | step on loopback | vs fp32 | loss (last 10 of {loss_steps}) | vs fp32 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"
for c, r in rows.items():
    across = f"{r['across']:.2f}" if r["across"] is not None else "-"
    loss = f"{r['loss']:.4f} | {100 * (r['loss'] / f['loss'] - 1):+.2f}%" if r["loss"] is not None else "- | -"
    print(f"| {c} | {r['mib']:.2f} | {ratio(f['mib'], r['mib'])} fewer | {across} | {ratio(f['across'], r['across'])} fewer | "
          f"{r['link_s']:.3f} s | {ratio(f['link_s'], r['link_s'])} | {r['loop_s']:.3f} s | {ratio(f['loop_s'], r['loop_s'])} | {loss} |")
json.dump({"strategy": strategy, "rate": rate, "steps": steps, "loss_steps": loss_steps, "nproc": nproc, "model": model,
           "rows": rows}, open(f"{out}/result.json", "w"), indent=1)
print(f"(files: {out})")
EOF
