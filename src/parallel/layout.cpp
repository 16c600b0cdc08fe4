#include "dtrain/parallel/layout.h"

#include <sstream>
#include <vector>

#include <c10/util/Exception.h>

namespace dtrain::parallel {

void Layout::validate(int world) const {
  TORCH_CHECK(replicate >= 1 && shard >= 1 && replicate * shard == world, "parallel layout ", describe(),
              " does not fit ", world, " ranks: replicate x shard must equal the world size (",
              "e.g. shard = ranks per node, replicate = number of nodes)");
}

std::string Layout::describe() const {
  std::ostringstream s;
  s << "replicate " << replicate << " x shard " << shard;
  return s.str();
}

Groups make_groups(const comm::ProcessGroup& world, const Layout& layout) {
  TORCH_CHECK(world.is_member(), "parallel layout: this rank is not a member of the process group");
  layout.validate(world.size());
  std::vector<std::vector<int>> shards(layout.replicate), replicas(layout.shard);
  for (int r = 0; r < world.size(); ++r) {
    shards[r / layout.shard].push_back(r);
    replicas[r % layout.shard].push_back(r);
  }
  Groups g;
  g.layout = layout;
  g.world = world;
  // Groups of one rank are created too (cheap), so the code paths are the same everywhere.
  g.shard = layout.shard == world.size() ? world : world.split(shards);
  g.replicate = layout.replicate == world.size() ? world : world.split(replicas);
  return g;
}

}  // namespace dtrain::parallel
