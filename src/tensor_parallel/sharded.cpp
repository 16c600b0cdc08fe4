#include "dtrain/tensor_parallel/sharded.h"

#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace dtrain::tensor_parallel {

// Design note [TP inside FSDP] (sharded.h).
fsdp::ShardView full_view(const fsdp::ShardView& local, const Plan& plan, bool writing) {
  fsdp::ShardView out;
  out.shards = local.shards;
  out.writes = local.writes;
  for (const auto& sl : local.slices) {
    if (!plan.is_cut(sl.name)) {
      if (!writing || plan.counts(sl.name)) out.slices.push_back(sl);
      continue;
    }
    const std::vector<int64_t> full = plan.full_shape(sl.name, sl.shape);
    for (const auto& seg : plan.segments(sl.name, sl.shape, sl.begin, sl.count)) {
      out.slices.push_back({sl.name, full, seg.full_begin, seg.count, sl.flat, sl.shard_offset + seg.piece_begin - sl.begin});
    }
  }
  return out;
}

void load_model(const checkpoint::Reader& reader, fsdp::FullyShardedState& fsdp, const Plan& plan) {
  const std::string prefix = checkpoint::model_key("");
  checkpoint::ModelKeys expected;  // full shapes
  std::unordered_map<std::string, std::vector<int64_t>> piece_shape;
  for (const auto& p : fsdp.parameter_infos()) {
    expected[prefix + p.name] = {plan.full_shape(p.name, p.shape), p.dtype};
    piece_shape[prefix + p.name] = p.shape;
  }
  for (const auto& [name, b] : fsdp.buffers()) expected[prefix + name] = {b.sizes().vec(), b.scalar_type()};
  checkpoint::check_model_keys(reader, expected);
  // FSDP asks for ranges of each piece; each is read as the runs of the full tensor it covers.
  fsdp.load_sharded_state_dict(
      [&](const std::string& key, int64_t b, int64_t e) {
        auto shape = piece_shape.find(key);
        if (shape == piece_shape.end()) return reader.read(key, b, e);  // a buffer
        const std::string name = key.substr(prefix.size());
        std::vector<at::Tensor> parts;
        for (const auto& seg : plan.segments(name, shape->second, b, e - b)) {
          parts.push_back(reader.read(key, seg.full_begin, seg.full_begin + seg.count));
        }
        return parts.size() == 1 ? parts[0] : at::cat(parts);
      },
      prefix);
}

}  // namespace dtrain::tensor_parallel
