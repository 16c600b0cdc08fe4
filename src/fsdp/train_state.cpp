#include "dtrain/fsdp/train_state.h"

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/optim/state_dict.h"

namespace dtrain::fsdp {

namespace {
const std::string kModel = checkpoint::model_key("");

// The trainable master shards (what the optimizer steps) and their indices in view.shards.
struct TrainableShards {
  std::vector<at::Tensor> tensors;
  std::vector<size_t> flat_of;
  explicit TrainableShards(const ShardView& view) {
    const auto& shards = view.shards;
    for (size_t i = 0; i < shards.size(); ++i) {
      if (!shards[i].requires_grad()) continue;
      tensors.push_back(shards[i]);
      flat_of.push_back(i);
    }
  }
};
}  // namespace

ShardView shard_view(const std::vector<const FlatParam*>& flats, bool writes) {
  ShardView v;
  v.writes = writes;
  for (size_t f = 0; f < flats.size(); ++f) {
    const FlatParam& flat = *flats[f];
    v.shards.push_back(flat.shard());
    for (size_t i = 0; i < flat.entries().size(); ++i) {
      auto [b, e] = flat.local_range(i);
      if (e == b) continue;
      const auto& entry = flat.entries()[i];
      v.slices.push_back({entry.name, entry.shape, b, e - b, f, entry.offset + b - flat.shard_begin()});
    }
  }
  return v;
}

ShardView shard_view(const FullyShardedState& fsdp) {
  return {fsdp.shards(), fsdp.slices(), fsdp.groups().replicate.rank() == 0};
}

std::vector<checkpoint::Piece> snapshot_params(const ShardView& view, const std::string& prefix) {
  std::vector<checkpoint::Piece> out;
  if (!view.writes) return out;
  for (const auto& sl : view.slices) {
    out.push_back({prefix + sl.name, sl.shape, sl.begin, view.shards[sl.flat].detach().narrow(0, sl.shard_offset, sl.count)});
  }
  return out;
}

void load_params(const checkpoint::Reader& reader, const ShardView& view) {
  at::NoGradGuard no_grad;
  for (const auto& sl : view.slices) {
    const std::string key = kModel + sl.name;
    TORCH_CHECK(reader.has(key), "checkpoint: ", key, " is missing; the checkpoint was saved from another model");
    const auto info = reader.info(key);
    TORCH_CHECK(info.shape == sl.shape, "checkpoint: ", key, " has shape ", c10::IntArrayRef(info.shape),
                " in the checkpoint but the model's is ", c10::IntArrayRef(sl.shape),
                "; the checkpoint was saved from another model");
    view.shards[sl.flat].detach().narrow(0, sl.shard_offset, sl.count).copy_(reader.read(key, sl.begin, sl.begin + sl.count));
  }
}

checkpoint::Snapshot snapshot_model(const FullyShardedState& fsdp) {
  checkpoint::Snapshot s;
  s.pieces = fsdp.sharded_state_dict(kModel);
  return s;
}

void load_model(const checkpoint::Reader& reader, FullyShardedState& fsdp) {
  // Names, shapes and dtypes of everything the module has.
  checkpoint::ModelKeys expected;
  for (const auto& p : fsdp.parameter_infos()) expected[checkpoint::model_key(p.name)] = {p.shape, p.dtype};
  for (const auto& [name, b] : fsdp.buffers()) expected[checkpoint::model_key(name)] = {b.sizes().vec(), b.scalar_type()};
  checkpoint::check_model_keys(reader, expected);
  fsdp.load_sharded_state_dict([&](const std::string& k, int64_t b, int64_t e) { return reader.read(k, b, e); },
                               kModel);
}

checkpoint::Snapshot snapshot_optimizer(const FullyShardedState& fsdp, const torch::optim::Optimizer& opt) {
  return snapshot_optimizer(shard_view(fsdp), opt);
}

void load_optimizer(const checkpoint::Reader& reader, FullyShardedState& fsdp, torch::optim::Optimizer& opt) {
  load_optimizer(reader, shard_view(fsdp), opt);
}

checkpoint::Snapshot snapshot_optimizer(const ShardView& view, const torch::optim::Optimizer& opt) {
  const TrainableShards trainable(view);
  const auto& flat_of = trainable.flat_of;
  const optim::OptimizerStateDict dict = optim::state_dict_view(opt, trainable.tensors);
  checkpoint::Snapshot s;
  // Replicas hold equal shards and equal optimizer state: the first replica writes them.
  const bool writes_shards = view.writes;
  for (const auto& sl : view.slices) {
    if (!writes_shards) break;
    const auto t = std::find(flat_of.begin(), flat_of.end(), sl.flat);
    if (t == flat_of.end()) continue;  // frozen
    const auto& state = dict.params[t - flat_of.begin()];
    if (!state) continue;
    for (const auto& [field, tensor] : state->tensors) {
      const std::string key = checkpoint::optim_key(sl.name, field);
      if (field == "step") {
        if (sl.begin == 0) s.pieces.push_back(checkpoint::whole_piece(key, tensor.detach()));
        continue;
      }
      s.pieces.push_back({key, sl.shape, sl.begin, tensor.detach().narrow(0, sl.shard_offset, sl.count)});
    }
  }
  checkpoint::put_optimizer_metadata(s.metadata, dict);
  return s;
}

void load_optimizer(const checkpoint::Reader& reader, const ShardView& view, torch::optim::Optimizer& opt) {
  checkpoint::check_optimizer_metadata(reader.metadata(), opt);
  const std::string kind = optim::optimizer_kind(opt);
  const auto& fields = optim::state_fields(kind);
  const TrainableShards shards(view);
  const auto& trainable = shards.tensors;
  const auto& flat_of = shards.flat_of;
  optim::OptimizerStateDict dict = optim::state_dict_of(opt, trainable);
  checkpoint::read_group_options(reader.metadata(), dict);
  const auto& slices = view.slices;
  for (size_t t = 0; t < trainable.size(); ++t) {
    optim::ParamStateDict entry;
    for (const auto& field : fields) {
      at::Tensor value;
      for (const auto& sl : slices) {
        if (sl.flat != flat_of[t]) continue;
        const std::string key = checkpoint::optim_key(sl.name, field);
        if (!reader.has(key)) continue;
        if (field == "step") {
          if (!value.defined()) value = reader.read(key).reshape({});
          continue;
        }
        const auto info = reader.info(key);
        TORCH_CHECK(info.shape == sl.shape && info.dtype == trainable[t].scalar_type(), "checkpoint: ", key,
                    " does not match parameter ", sl.name, " (shape or dtype); saved from another model");
        if (!value.defined()) value = at::zeros_like(trainable[t]).detach();
        value.narrow(0, sl.shard_offset, sl.count).copy_(reader.read(key, sl.begin, sl.begin + sl.count));
      }
      if (value.defined()) entry.tensors[field] = value;
    }
    dict.params[t] = entry.tensors.empty() ? std::nullopt : std::optional<optim::ParamStateDict>(std::move(entry));
  }
  optim::load_state_dict_into(opt, trainable, dict);
}

}  // namespace dtrain::fsdp
