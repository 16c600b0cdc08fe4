#pragma once
// What this process has handed to collectives, by kind: the payload (the tensor a call moves or
// reduces: all_reduce's tensor, all_gather's output, reduce_scatter's input, a broadcast's or a
// send's tensor), counted when the call starts, groups of one rank excluded. The bytes on the wire
// follow from the algorithm (a ring all-reduce sends 2 (n - 1) / n of its payload per rank, an
// all-gather or a reduce-scatter (n - 1) / n). The training loop reports the payload per step
// (metrics field comm_mib); bench/tensor_parallel_bench.py sets it against Megatron's formulas.
//
// Within and across nodes: the ring algorithms send to the next member of the group (Gloo's and
// NCCL's rings go in rank order), so a rank's ring bytes cross to another node when its successor
// is on another node (ProcessGroup::member_nodes); an all-to-all (also under Gloo's reduce-scatter
// and its all-gather with a workspace) sends each member its share (with split sizes, exactly what
// each gets), a send goes to its peer. Counted per group too, under the group's label (ProcessGroup::label:
// "shard", "replicate", "tensor", ... where the layout made it, else its name).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dtrain::comm {

struct Traffic {
  int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0, broadcast = 0, send = 0, recv = 0, all_to_all = 0;
  int64_t calls = 0;
  // The bytes this rank sends with ring algorithms over groups of n: 2 (n-1)/n of an all-reduce's
  // payload, (n-1)/n of an all-gather's, a reduce-scatter's, an all-to-all's and a broadcast's
  // (pipelined ring), all of a send.
  int64_t ring_bytes_sent = 0;
  int64_t across_nodes_sent = 0;  // the part of ring_bytes_sent that went to another node
  struct Group {
    int64_t sent = 0, across_nodes = 0;
  };
  std::map<std::string, Group> by_group;  // ring_bytes_sent (and its part across nodes) per group label
  int64_t total() const { return all_reduce + all_gather + reduce_scatter + broadcast + send + recv + all_to_all; }
};

// Since the process started (thread-safe counters).
Traffic traffic();

class ProcessGroup;
namespace detail {
enum class TrafficKind { AllReduce, AllGather, ReduceScatter, Broadcast, Send, Recv, AllToAll };
// `peer`: a send's destination (group rank). `direct`: the collective runs as an all-to-all
// underneath (Gloo's reduce-scatter, its all-gather with a workspace): each peer gets its share
// straight from this rank, not from a ring neighbour.
void count_traffic(TrafficKind kind, int64_t bytes, const ProcessGroup& pg, int peer = -1, bool direct = false);
// An all-to-all of uneven splits, exactly: `bytes_to[r]` bytes to group rank r (this rank's own
// part stays here).
void count_all_to_all(const std::vector<int64_t>& bytes_to, const ProcessGroup& pg);
}  // namespace detail

}  // namespace dtrain::comm
