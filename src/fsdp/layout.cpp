#include "dtrain/fsdp/layout.h"

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

void MeshLayout::validate(int world) const {
  TORCH_CHECK(replicate >= 1 && shard >= 1 && replicate * shard == world, "FSDP layout ", describe(),
              " does not fit ", world, " ranks: replicate x shard must equal the world size (",
              "e.g. shard = ranks per node, replicate = number of nodes)");
}

std::string MeshLayout::describe() const {
  std::ostringstream s;
  s << "replicate " << replicate << " x shard " << shard;
  return s.str();
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

ShardGroups make_groups(const comm::ProcessGroup& world, const MeshLayout& layout) {
  TORCH_CHECK(world.is_member(), "FSDP: this rank is not a member of the process group");
  layout.validate(world.size());
  std::vector<std::vector<int>> shards(layout.replicate), replicas(layout.shard);
  for (int r = 0; r < world.size(); ++r) {
    shards[r / layout.shard].push_back(r);
    replicas[r % layout.shard].push_back(r);
  }
  ShardGroups g;
  g.layout = layout;
  g.world = world;
  // Groups of one rank are created too (cheap), so the code paths are the same everywhere.
  g.shard = layout.shard == world.size() ? world : world.split(shards);
  g.replicate = layout.replicate == world.size() ? world : world.split(replicas);
  return g;
}

}  // namespace dtrain::fsdp
