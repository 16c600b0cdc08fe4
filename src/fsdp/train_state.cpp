#include "dtrain/fsdp/train_state.h"

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/optim/state_dict.h"

namespace dtrain::fsdp {

namespace {
const std::string kModel = "model/";
const std::string kOptim = "optim/";

std::string group_key(size_t g, const std::string& option) { return "optim/group/" + std::to_string(g) + "/" + option; }
}  // namespace

checkpoint::Snapshot snapshot_model(const FullyShardedState& fsdp) {
  checkpoint::Snapshot s;
  s.pieces = fsdp.sharded_state_dict(kModel);
  return s;
}

void load_model(const checkpoint::Reader& reader, FullyShardedState& fsdp) {
  // Names, shapes and dtypes of everything the module has.
  std::map<std::string, std::pair<std::vector<int64_t>, at::ScalarType>> expected;
  for (const auto& p : fsdp.parameter_infos()) expected[kModel + p.name] = {p.shape, p.dtype};
  for (const auto& [name, b] : fsdp.buffers()) expected[kModel + name] = {b.sizes().vec(), b.scalar_type()};
  for (const auto& key : reader.keys_with_prefix(kModel)) {
    TORCH_CHECK(expected.count(key), "checkpoint: ", key, " is not a parameter or buffer of the model; the checkpoint "
                "was saved from another model (e.g. other --layers)");
  }
  for (const auto& [key, want] : expected) {
    TORCH_CHECK(reader.has(key), "checkpoint: ", key, " is missing; the checkpoint was saved from another model");
    const auto info = reader.info(key);
    TORCH_CHECK(info.shape == want.first, "checkpoint: ", key, " has shape ", c10::IntArrayRef(info.shape),
                " in the checkpoint but the model's is ", c10::IntArrayRef(want.first),
                "; the checkpoint was saved from another model (e.g. other --d-model)");
    TORCH_CHECK(info.dtype == want.second, "checkpoint: ", key, " is ", info.dtype, " in the checkpoint but ",
                want.second, " in the model");
  }
  fsdp.load_sharded_state_dict([&](const std::string& k, int64_t b, int64_t e) { return reader.read(k, b, e); },
                               kModel);
}

checkpoint::Snapshot snapshot_optimizer(const FullyShardedState& fsdp, const torch::optim::Optimizer& opt) {
  const auto shards = fsdp.shards();
  std::vector<at::Tensor> trainable;
  std::vector<size_t> flat_of;  // trainable index -> shards() index
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].requires_grad()) {
      trainable.push_back(shards[i]);
      flat_of.push_back(i);
    }
  }
  const optim::OptimizerStateDict dict = optim::state_dict_of(opt, trainable);
  checkpoint::Snapshot s;
  // Replicas hold equal shards and equal optimizer state: the first replica writes them.
  const bool writes_shards = fsdp.groups().replicate.rank() == 0;
  for (const auto& sl : fsdp.slices()) {
    if (!writes_shards) break;
    const auto t = std::find(flat_of.begin(), flat_of.end(), sl.flat);
    if (t == flat_of.end()) continue;  // frozen
    const auto& state = dict.params[t - flat_of.begin()];
    if (!state) continue;
    for (const auto& [field, tensor] : state->tensors) {
      const std::string key = kOptim + sl.name + "/" + field;
      if (field == "step") {
        if (sl.begin == 0) s.pieces.push_back(checkpoint::whole_piece(key, tensor.detach()));
        continue;
      }
      s.pieces.push_back({key, sl.shape, sl.begin, tensor.detach().narrow(0, sl.shard_offset, sl.count)});
    }
  }
  checkpoint::put(s.metadata, "optim/kind", dict.optimizer);
  checkpoint::put(s.metadata, "optim/groups", static_cast<int64_t>(dict.groups.size()));
  for (size_t g = 0; g < dict.groups.size(); ++g) {
    for (const auto& [option, v] : dict.groups[g].options) checkpoint::put(s.metadata, group_key(g, option), v);
  }
  return s;
}

void load_optimizer(const checkpoint::Reader& reader, FullyShardedState& fsdp, torch::optim::Optimizer& opt) {
  const auto& meta = reader.metadata();
  const std::string kind = optim::optimizer_kind(opt);
  const std::string& saved = checkpoint::get_string(meta, "optim/kind");
  TORCH_CHECK(saved == kind, "checkpoint: optim/kind is ", saved, " in the checkpoint but the optimizer is ", kind,
              "; resume with the optimizer the checkpoint was saved with (e.g. --optimizer)");
  const int64_t groups = checkpoint::get_int(meta, "optim/groups");
  TORCH_CHECK(groups == static_cast<int64_t>(opt.param_groups().size()), "checkpoint: optim/groups is ", groups,
              " in the checkpoint but the optimizer has ", opt.param_groups().size(), " param group(s)");
  const auto& fields = optim::state_fields(kind);
  const auto shards = fsdp.shards();
  std::vector<at::Tensor> trainable;
  std::vector<size_t> flat_of;
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].requires_grad()) {
      trainable.push_back(shards[i]);
      flat_of.push_back(i);
    }
  }
  optim::OptimizerStateDict dict = optim::state_dict_of(opt, trainable);
  for (size_t g = 0; g < dict.groups.size(); ++g) {
    for (auto& [option, v] : dict.groups[g].options) v = checkpoint::get_double(meta, group_key(g, option));
  }
  const auto slices = fsdp.slices();
  for (size_t t = 0; t < trainable.size(); ++t) {
    optim::ParamStateDict entry;
    for (const auto& field : fields) {
      at::Tensor value;
      for (const auto& sl : slices) {
        if (sl.flat != flat_of[t]) continue;
        const std::string key = kOptim + sl.name + "/" + field;
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
