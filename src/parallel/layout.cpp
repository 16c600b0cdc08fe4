#include "dtrain/parallel/layout.h"

#include <sstream>
#include <vector>

#include <c10/util/Exception.h>

namespace dtrain::parallel {

void Layout::validate(int world) const {
  TORCH_CHECK(replicate >= 1 && shard >= 1 && pipeline >= 1 && size() == world, "parallel layout ", describe(),
              " does not fit ", world, " ranks: ", pipeline > 1 ? "pipeline x " : "",
              "replicate x shard must equal the world size (",
              pipeline > 1 ? "--pp must divide the ranks; " : "",
              "e.g. shard = ranks per node, replicate = number of nodes)");
}

std::string Layout::describe() const {
  std::ostringstream s;
  if (pipeline != 1) s << "pipeline " << pipeline << " x ";
  s << "replicate " << replicate << " x shard " << shard;
  return s.str();
}

Groups make_groups(const comm::ProcessGroup& world, const Layout& layout) {
  TORCH_CHECK(world.is_member(), "parallel layout: this rank is not a member of the process group");
  layout.validate(world.size());
  const int d = layout.data_parallel();
  std::vector<std::vector<int>> shards(layout.replicate * layout.pipeline), replicas(layout.shard * layout.pipeline),
      pipelines(d), datas(layout.pipeline);
  for (int r = 0; r < world.size(); ++r) {
    const int stage = r / d, dp = r % d;
    shards[stage * layout.replicate + dp / layout.shard].push_back(r);
    replicas[stage * layout.shard + dp % layout.shard].push_back(r);
    pipelines[dp].push_back(r);
    datas[stage].push_back(r);
  }
  Groups g;
  g.layout = layout;
  g.world = world;
  // Groups of one rank are created too (cheap), so the code paths are the same everywhere.
  g.shard = layout.shard == world.size() ? world : world.split(shards);
  g.replicate = layout.replicate == world.size() ? world : world.split(replicas);
  g.pipeline = layout.pipeline == world.size() ? world : world.split(pipelines);
  g.data = d == world.size() ? world : d == layout.shard ? g.shard : d == layout.replicate ? g.replicate : world.split(datas);
  return g;
}

}  // namespace dtrain::parallel
