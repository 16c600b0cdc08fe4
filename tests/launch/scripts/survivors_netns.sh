#!/usr/bin/env bash
# In-process recovery across a lost link (--keep-survivors, Design note [in-process recovery]): two
# "machines", network namespaces A (10.77.N.1, node 0, the store) and B (10.77.N.2, node 1) joined
# by a veth pair, a dtrun each with --nnodes 2 and two ranks. Once the job has trained 3 steps, B's
# link goes down: node 0's dtrun declares node 1's ranks dead when its heartbeat stops, and node
# 0's two ranks go on in their processes at half the size. Node 0 writes the metrics to
# OUT_DIR/m.jsonl, the logs go to OUT_DIR/n0.log and n1.log; prints node0_exit=C and node1_exit=C
# (node 1, cut off from the store, stops by itself). Exit 77 (skip) where this machine does not
# let us create namespaces.
# Usage: survivors_netns.sh BIN_DIR OUT_DIR WORKER_ARGS...
set -uo pipefail
bin=$1
out=$2
shift 2
cleanup() {
  [[ -n "${p1:-}" ]] && kill -KILL "$p1" 2>/dev/null
  [[ -n "${p0:-}" ]] && kill -KILL "$p0" 2>/dev/null
  netns_pair_cleanup
}
source "$(dirname "$0")/netns_pair.sh" ks
trap cleanup EXIT

common=(--nnodes 2 --nproc-per-node 2 --master-addr "10.77.$net.1" --master-port 29500 --rdzv-timeout 60
        --heartbeat-timeout 3 --keep-survivors)
export DTRAIN_TEST_SLOW_STEP_MS=200
ip netns exec "$b" "$bin/dtrun" "${common[@]}" --node-rank 1 "$bin/dtrain-gpt" "$@" >"$out/n1.log" 2>&1 &
p1=$!
ip netns exec "$a" "$bin/dtrun" "${common[@]}" --node-rank 0 "$bin/dtrain-gpt" "$@" --metrics "$out/m.jsonl" \
  >"$out/n0.log" 2>&1 &
p0=$!
netns_link_down_after_three_steps "$out/m.jsonl"
