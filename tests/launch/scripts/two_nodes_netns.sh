#!/usr/bin/env bash
# Two "machines" on one: network namespaces A (10.77.N.1) and B (10.77.N.2) joined by a veth pair,
# no GLOO_SOCKET_IFNAME. dtrun runs node 0 in A (hosting the store at its address) and node 1 in B;
# their DDP job must train to the standalone two-rank run's parameters. Exit 77 (skip) where this
# machine does not let us create namespaces.  Usage: two_nodes_netns.sh BIN_DIR OUT_DIR
set -uo pipefail
bin=$1
out=$2
source "$(dirname "$0")/netns_pair.sh" dt
trap netns_pair_cleanup EXIT

prog=("$bin/dtrain-mlp" --strategy ddp --hidden 24 --depth 2 --samples 256 --batch-size 4 --steps 4 --threads 1)
common=(--nnodes 2 --nproc-per-node 1 --master-addr "10.77.$net.1" --master-port 29500 --rdzv-timeout 60)
ip netns exec "$a" env -u GLOO_SOCKET_IFNAME "$bin/dtrun" "${common[@]}" --node-rank 0 "${prog[@]}" \
  --metrics "$out/two.jsonl" >"$out/node0.txt" 2>&1 &
p0=$!
ip netns exec "$b" env -u GLOO_SOCKET_IFNAME "$bin/dtrun" "${common[@]}" --node-rank 1 "${prog[@]}" >"$out/node1.txt" 2>&1 &
p1=$!
rc0=0 rc1=0
wait $p0 || rc0=$?
wait $p1 || rc1=$?
echo "--- node 0 (exit $rc0)"; cat "$out/node0.txt"
echo "--- node 1 (exit $rc1)"; cat "$out/node1.txt"
[[ $rc0 == 0 && $rc1 == 0 ]] || { echo "FAIL: the two-node job failed"; exit 1; }
"$bin/dtrun" --standalone --nproc-per-node 2 "${prog[@]}" --metrics "$out/one.jsonl" >"$out/standalone.txt" 2>&1 ||
  { cat "$out/standalone.txt"; echo "FAIL: the standalone job failed"; exit 1; }
two=$(grep -o '"param_checksum": [^,]*' "$out/two.jsonl")
one=$(grep -o '"param_checksum": [^,]*' "$out/one.jsonl")
echo "two nodes: $two; standalone: $one"
[[ -n "$two" && "$two" == "$one" ]] || { echo "FAIL: the checksums differ"; exit 1; }
echo "two-node ok"
