#pragma once
// How FSDP lays ranks out: a sharding strategy and the 2-D parallel layout (replicate x shard,
// dtrain/parallel/layout.h) it implies, as PyTorch's ShardingStrategy and HSDP's 2-D device mesh.
// Parameters are sharded over a shard group and replicated across the replicate group; gradients
// are reduce-scattered in the shard group, then all-reduced across the replicate group.
#include <string>

#include "dtrain/parallel/layout.h"

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

// The layout and its groups are the library's one parallel layout (dtrain/parallel/layout.h).
using MeshLayout = parallel::Layout;
using ShardGroups = parallel::Groups;
using parallel::make_groups;

// The layout a strategy uses on `world` ranks: FullShard/ShardGradOp {1, W}, NoShard {W, 1},
// HybridShard `hybrid` (validated; when hybrid.shard is 0 it defaults to ranks per node:
// LOCAL_WORLD_SIZE from the environment, or W when unset).
MeshLayout layout_for(ShardingStrategy s, int world, MeshLayout hybrid = {0, 0});

}  // namespace dtrain::fsdp
