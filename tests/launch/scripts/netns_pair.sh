# Sourced by the network-namespace tests: two "machines" A (10.77.N.1) and B (10.77.N.2) joined by
# a veth pair, named after the sourcing shell's pid ($1: a two-letter prefix keeping the tests'
# names apart). Sets a, b (the namespaces), va, vb (their ends) and net (N); the caller's EXIT
# trap calls netns_pair_cleanup. Exits 77 (skip) where this machine does not let us create them.
command -v ip >/dev/null || { echo "SKIP: no ip command (iproute2 is not installed)"; exit 77; }
[[ $(id -u) == 0 ]] || { echo "SKIP: creating network namespaces needs root"; exit 77; }
id=$$
a=${1}A$id b=${1}B$id va=${1}a$id vb=${1}b$id net=$((id % 200 + 20))
netns_pair_cleanup() { ip netns del "$a" 2>/dev/null; ip netns del "$b" 2>/dev/null; }
ip netns add "$a" 2>/dev/null || { echo "SKIP: this machine does not let us create a network namespace"; exit 77; }
ip netns add "$b" && ip link add "$va" type veth peer name "$vb" &&
  ip link set "$va" netns "$a" && ip link set "$vb" netns "$b" &&
  ip -n "$a" addr add "10.77.$net.1/24" dev "$va" && ip -n "$b" addr add "10.77.$net.2/24" dev "$vb" &&
  ip -n "$a" link set lo up && ip -n "$b" link set lo up &&
  ip -n "$a" link set "$va" up && ip -n "$b" link set "$vb" up ||
  { netns_pair_cleanup; echo "SKIP: cannot set up the veth pair here"; exit 77; }
# The link-down scenario both elastic namespace tests share: once METRICS has 3 step records, B's
# link goes down; then node 0's dtrun ($p0) is waited for and node 1's ($p1), cut off from the
# store, must stop by itself within 30 s. Prints node0_exit=C and node1_exit=C.
netns_link_down_after_three_steps() {
  local metrics=$1 rc0=0 rc1=0
  for _ in $(seq 1200); do
    [[ $(grep -c '"step": ' "$metrics" 2>/dev/null) -ge 3 ]] 2>/dev/null && break
    sleep 0.05
  done
  ip -n "$b" link set "$vb" down && echo "node 1's link is down"
  wait "$p0" || rc0=$?
  echo "node0_exit=$rc0"
  for _ in $(seq 600); do kill -0 "$p1" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$p1" 2>/dev/null && { echo "node 1's dtrun is still running 30 s after node 0 ended"; kill -KILL "$p1"; }
  wait "$p1" || rc1=$?
  echo "node1_exit=$rc1"
  p0= p1=
}
