#pragma once
// How FSDP lays ranks out: a sharding strategy and a 2-D layout (replicate x shard) whose product
// is the world size, as PyTorch's ShardingStrategy and HSDP's 2-D device mesh.
//
//   world 8, hybrid {replicate 2, shard 4}:   shard groups {0 1 2 3} {4 5 6 7}   (e.g. one per node)
//                                             replicate groups {0 4} {1 5} {2 6} {3 7}
// Parameters are sharded over a shard group and replicated across the replicate group; gradients
// are reduce-scattered in the shard group, then all-reduced across the replicate group.
#include <string>

#include "dtrain/comm/process_group.h"

namespace dtrain::fsdp {

enum class ShardingStrategy {
  FullShard,    // ZeRO-3: parameters, gradients and optimizer state sharded over all ranks;
                // parameters freed after each unit's forward and gathered again for backward
  ShardGradOp,  // ZeRO-2-like: as FullShard, but a unit's parameters stay gathered from its
                // forward until its backward is done (no second all-gather)
  NoShard,      // DDP-like: every rank holds everything, gradients all-reduced (layout {W, 1})
  HybridShard,  // FullShard within a shard group, replicated across groups (layout {R, S})
};

const char* to_string(ShardingStrategy s);
// "full" | "grad_op" | "none" | "hybrid" (the demo's --sharding values); throws naming the value.
ShardingStrategy parse_sharding(const std::string& name);

// The parallel layout as one validated value: replicate x shard == world size.
struct MeshLayout {
  int replicate = 1;
  int shard = 1;
  // Throws (naming the degrees, the world size and what to do) unless both are >= 1 and their
  // product is `world`.
  void validate(int world) const;
  std::string describe() const;  // "replicate 2 x shard 4"
};

// The layout a strategy uses on `world` ranks: FullShard/ShardGradOp {1, W}, NoShard {W, 1},
// HybridShard `hybrid` (validated; when hybrid.shard is 0 it defaults to ranks per node:
// LOCAL_WORLD_SIZE from the environment, or W when unset).
MeshLayout layout_for(ShardingStrategy s, int world, MeshLayout hybrid = {0, 0});

// The process groups of a layout (every rank of `world` must call make_groups alike).
struct ShardGroups {
  MeshLayout layout;
  comm::ProcessGroup world;
  comm::ProcessGroup shard;      // this rank's shard group (size layout.shard)
  comm::ProcessGroup replicate;  // this rank's replicate group (size layout.replicate)
};
ShardGroups make_groups(const comm::ProcessGroup& world, const MeshLayout& layout);

}  // namespace dtrain::fsdp
