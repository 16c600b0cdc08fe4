#pragma once
// The parallel layout: how the ranks of a job are laid out, as one validated value (torchtitan's
// ParallelDims, PyTorch's DeviceMesh): pipeline x data-parallel replicate x data-parallel shard,
// whose product is the world size. Every strategy takes its process groups from it (train::parallelize takes
// them once): DDP all-reduces over the replicate group (layout {W, 1}), ZeRO-1/2 and FSDP shard over
// the shard group ({1, W}), HSDP shards within a shard group and replicates across groups ({R, S}).
//
//   world 8, {replicate 2, shard 4}:   shard groups {0 1 2 3} {4 5 6 7}   (e.g. one per node)
//                                      replicate groups {0 4} {1 5} {2 6} {3 7}
//
// The pipeline dimension is outermost (as torchtitan's mesh ["pp", "dp", ...]): the D = replicate
// x shard ranks of one pipeline stage are consecutive (one node does a stage's data-parallel
// traffic), rank = stage rank x D + data-parallel rank; a pipeline group holds the ranks of one
// data-parallel rank across the stages.
//   world 4, {pipeline 2, replicate 2}: pipeline groups {0 2} {1 3}; replicate groups {0 1} {2 3}
#include <string>

#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::parallel {

struct Layout {
  int replicate = 1;
  int shard = 1;
  int pipeline = 1;
  // Tensor parallelism, innermost: the T ranks of one tensor-parallel group are consecutive (one
  // node carries its per-layer traffic), rank = (stage rank x D + data-parallel rank) x T + tensor
  // rank. Data-parallel groups (replicate, shard, data) and pipeline groups join ranks of the same
  // tensor rank.
  int tensor = 1;
  // Throws (naming the degrees, the world size and what to do) unless every degree is >= 1 and
  // their product is `world`.
  void validate(int world) const;
  int size() const { return replicate * shard * pipeline * tensor; }
  int data_parallel() const { return replicate * shard; }
  // Where world rank `rank` sits (the rank formula above, in one place).
  int tensor_rank(int rank) const { return rank % tensor; }
  int data_parallel_rank(int rank) const { return (rank / tensor) % data_parallel(); }
  int pipeline_rank(int rank) const { return rank / (tensor * data_parallel()); }
  std::string describe() const;  // "replicate 2 x shard 4" ("pipeline 2 x ...", "... x tensor 2" when > 1)
};

// The process groups of a layout; every rank of `world` calls make_groups alike (collective).
// Within a pipeline stage's block of ranks, a rank d is shard rank d % shard of shard group
// d / shard (consecutive ranks: one node).
struct Groups {
  Layout layout;
  comm::ProcessGroup world;
  comm::ProcessGroup shard;      // this rank's shard group (size layout.shard)
  comm::ProcessGroup replicate;  // this rank's replicate group (size layout.replicate)
  comm::ProcessGroup pipeline;   // this rank's pipeline group (size layout.pipeline)
  comm::ProcessGroup data;       // this rank's data-parallel group (size replicate x shard)
  comm::ProcessGroup tensor;     // this rank's tensor-parallel group (size layout.tensor)
  // The shard group split by node, where FSDP reduce-scatters quantized in two levels (made by
  // FSDP under --reduce-quant; empty otherwise, or where the shard group is on one node).
  comm::NodeGroups shard_nodes;
};
Groups make_groups(const comm::ProcessGroup& world, const Layout& layout);

}  // namespace dtrain::parallel
