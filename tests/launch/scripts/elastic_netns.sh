#!/usr/bin/env bash
# An elastic job (--nnodes 1:2) on two "machines": network namespaces A (10.77.N.1, node 0, the
# store) and B (10.77.N.2, node 1) joined by a veth pair. Once the job has trained 3 steps, B's link
# goes down: node 0 must drop node 1 (its heartbeat stops) and finish the run alone from the newest
# checkpoint. Leaves each round's metrics in OUT_DIR/m<round>.jsonl and the logs in OUT_DIR; the
# caller compares the run with the uninterrupted one. Prints node0_exit=C and node1_exit=C. Exit
# 77 (skip) where this machine does not let us create namespaces. NPROC=N runs N ranks a node (1),
# DTRUN_FLAGS adds dtrun flags (--keep-survivors: the survivors' refused recovery, then the restart).
# Usage: elastic_netns.sh BIN_DIR OUT_DIR WORKER_ARGS...
set -uo pipefail
bin=$1
out=$2
shift 2
cleanup() {
  [[ -n "${p1:-}" ]] && kill -KILL "$p1" 2>/dev/null
  [[ -n "${p0:-}" ]] && kill -KILL "$p0" 2>/dev/null
  netns_pair_cleanup
}
source "$(dirname "$0")/netns_pair.sh" de
trap cleanup EXIT

worker="exec $bin/dtrain-gpt $* --metrics $out/m\$TORCHELASTIC_RESTART_COUNT.jsonl"
common=(--nnodes 1:2 --nproc-per-node "${NPROC:-1}" --master-addr "10.77.$net.1" --master-port 29500 --rdzv-timeout 60
        --heartbeat-timeout 3 --rdzv-last-call 2 --max-restarts 1 ${DTRUN_FLAGS:-})
export DTRAIN_TEST_SLOW_STEP_MS=300
ip netns exec "$b" "$bin/dtrun" "${common[@]}" --node-rank 1 sh -c "$worker" >"$out/n1.log" 2>&1 &
p1=$!
ip netns exec "$a" "$bin/dtrun" "${common[@]}" --node-rank 0 sh -c "$worker" >"$out/n0.log" 2>&1 &
p0=$!
netns_link_down_after_three_steps "$out/m0.jsonl"
