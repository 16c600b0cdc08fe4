#include "dtrain/fsdp/layout.h"
#include "dtrain/fsdp/secondary_shard.h"

#include <cstdlib>
#include <sstream>
#include <vector>

#include <c10/util/Exception.h>

namespace dtrain::fsdp {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FullShard: return "full";
    case ShardingStrategy::ShardGradOp: return "grad_op";
    case ShardingStrategy::NoShard: return "none";
    case ShardingStrategy::HybridShard: return "hybrid";
  }
  return "?";
}

ShardingStrategy parse_sharding(const std::string& name) {
  if (name == "full") return ShardingStrategy::FullShard;
  if (name == "grad_op") return ShardingStrategy::ShardGradOp;
  if (name == "none") return ShardingStrategy::NoShard;
  if (name == "hybrid") return ShardingStrategy::HybridShard;
  TORCH_CHECK(false, "unknown sharding strategy '", name, "': use full, grad_op, none or hybrid");
}

const char* to_string(SecondaryShard s) { return s == SecondaryShard::Node ? "node" : "none"; }

SecondaryShard parse_secondary_shard(const std::string& text) {
  if (text == "none") return SecondaryShard::None;
  if (text == "node") return SecondaryShard::Node;
  TORCH_CHECK(false, "--secondary-shard expects none or node (a copy of each unit's parameters over the node's ranks "
              "for the backward's gather), got '", text, "'");
}

MeshLayout layout_for(ShardingStrategy s, int world, MeshLayout hybrid) {
  MeshLayout l;
  switch (s) {
    case ShardingStrategy::FullShard:
    case ShardingStrategy::ShardGradOp: l = {1, world}; break;
    case ShardingStrategy::NoShard: l = {world, 1}; break;
    case ShardingStrategy::HybridShard: {
      l = hybrid;
      if (l.shard == 0) {
        const char* local = std::getenv("LOCAL_WORLD_SIZE");
        l.shard = local ? std::atoi(local) : world;
      }
      if (l.replicate == 0 && l.shard > 0) l.replicate = world / l.shard;
      break;
    }
  }
  l.validate(world);
  return l;
}

}  // namespace dtrain::fsdp
