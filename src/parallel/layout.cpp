#include "dtrain/parallel/layout.h"

#include <map>
#include <sstream>
#include <vector>

#include <c10/util/Exception.h>

namespace dtrain::parallel {

void Layout::validate(int world) const {
  TORCH_CHECK(replicate >= 1 && shard >= 1 && pipeline >= 1 && tensor >= 1 && size() == world, "parallel layout ",
              describe(), " does not fit ", world, " ranks: ", pipeline > 1 ? "pipeline x " : "", "replicate x shard",
              tensor > 1 ? " x tensor" : "", " must equal the world size (", pipeline > 1 ? "--pp must divide the ranks; " : "",
              tensor > 1 ? "--tp must divide the ranks; " : "",
              "e.g. shard = ranks per node, replicate = number of nodes)");
}

std::string Layout::describe() const {
  std::ostringstream s;
  if (pipeline != 1) s << "pipeline " << pipeline << " x ";
  s << "replicate " << replicate << " x shard " << shard;
  if (tensor != 1) s << " x tensor " << tensor;
  return s.str();
}

Groups make_groups(const comm::ProcessGroup& world, const Layout& layout) {
  TORCH_CHECK(world.is_member(), "parallel layout: this rank is not a member of the process group");
  layout.validate(world.size());
  const int d = layout.data_parallel(), t = layout.tensor;
  // Each partition: key -> ranks, keys in a fixed order (every rank computes the same partition).
  std::map<std::vector<int>, std::vector<int>> shards, replicas, pipelines, datas, tensors;
  for (int r = 0; r < world.size(); ++r) {
    const int tp = layout.tensor_rank(r), block = r / t;
    const int stage = layout.pipeline_rank(r), dp = layout.data_parallel_rank(r);
    shards[{stage, dp / layout.shard, tp}].push_back(r);
    replicas[{stage, dp % layout.shard, tp}].push_back(r);
    pipelines[{dp, tp}].push_back(r);
    datas[{stage, tp}].push_back(r);
    tensors[{block}].push_back(r);
  }
  auto parts = [](const std::map<std::vector<int>, std::vector<int>>& m) {
    std::vector<std::vector<int>> out;
    for (const auto& [key, ranks] : m) out.push_back(ranks);
    return out;
  };
  Groups g;
  g.layout = layout;
  g.world = world;
  // Groups of one rank are created too (cheap), so the code paths are the same everywhere.
  g.shard = layout.shard == world.size() ? world : world.split(parts(shards), "shard");
  g.replicate = layout.replicate == world.size() ? world : world.split(parts(replicas), "replicate");
  g.pipeline = layout.pipeline == world.size() ? world : world.split(parts(pipelines), "pipeline");
  g.data = d == world.size() ? world : d == layout.shard ? g.shard : d == layout.replicate ? g.replicate : world.split(parts(datas), "data");
  g.tensor = t == world.size() ? world : world.split(parts(tensors), "tensor");
  return g;
}

}  // namespace dtrain::parallel
