#include "dtrain/checkpoint/train_state.h"

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <set>
#include <unordered_map>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include "dtrain/optim/state_dict.h"
#include "dtrain/util/parse.h"

namespace dtrain::checkpoint {

namespace {

constexpr const char* kModelPrefix = "model/";
constexpr const char* kOptimPrefix = "optim/";

std::vector<int64_t> shape_of(const at::Tensor& t) { return t.sizes().vec(); }

void add_replicated(Snapshot& s, std::string key, const at::Tensor& t, int rank, int world) {
  if (auto p = replicated_piece(std::move(key), t.detach(), rank, world)) s.pieces.push_back(std::move(*p));
}

// Every parameter, then every buffer, by its name in `module` (recursively).
std::vector<std::pair<std::string, at::Tensor>> named_tensors(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) { return c10::str(c10::IntArrayRef(shape)); }

// Throws unless the checkpoint's `key` has `like`'s shape and dtype; `what` names the tensor.
void check_like(const Reader& reader, const std::string& key, const at::Tensor& like, const std::string& what) {
  const TensorInfo info = reader.info(key);
  TORCH_CHECK(info.shape == shape_of(like), "checkpoint: ", key, " has shape ", shape_text(info.shape),
              " in the checkpoint but ", what, " has shape ", like.sizes(),
              "; the checkpoint was saved from another model (other layer sizes?)");
  TORCH_CHECK(info.dtype == like.scalar_type(), "checkpoint: ", key, " is ", info.dtype, " in the checkpoint but ",
              what, " is ", like.scalar_type(), "; convert the model to ", info.dtype, " before loading");
}

// Options of group g as metadata keys.
std::string group_key(size_t g, const std::string& option) {
  return "optim/group/" + std::to_string(g) + "/" + option;
}

Snapshot optimizer_snapshot(const optim::OptimizerStateDict& dict, const std::vector<std::string>& names,
                            bool replicated, int rank, int world) {
  TORCH_CHECK(names.size() == dict.params.size(), "checkpoint: ", names.size(), " parameter names for ",
              dict.params.size(), " parameters; pass one name per parameter, in the same order");
  Snapshot s;
  for (size_t i = 0; i < dict.params.size(); ++i) {
    if (!dict.params[i]) continue;
    for (const auto& [field, t] : dict.params[i]->tensors) {
      std::string key = optim_key(names[i], field);
      if (replicated) {
        add_replicated(s, std::move(key), t, rank, world);
      } else {
        s.pieces.push_back(whole_piece(std::move(key), t.detach()));
      }
    }
  }
  put_optimizer_metadata(s.metadata, dict);
  return s;
}

std::vector<at::Tensor> pick(const std::vector<at::Tensor>& all, const std::vector<size_t>& idx) {
  std::vector<at::Tensor> out;
  for (size_t i : idx) out.push_back(all[i]);
  return out;
}

// Loads into `opt`, whose parameters are all_params[mine[j]] (in that order), from the keys of
// all_names[mine[j]]. Every optim/ key of the checkpoint must name one of all_names and a field of
// the optimizer's type.
void load_optimizer_impl(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& all_names,
                         const std::vector<at::Tensor>& all_params, const std::vector<size_t>& mine,
                         const Pieces& pieces = {}) {
  TORCH_CHECK(all_names.size() == all_params.size(), "checkpoint: ", all_names.size(), " parameter names for ",
              all_params.size(), " parameters; pass one name per parameter, in the same order");
  const std::string kind = optim::optimizer_kind(opt);
  check_optimizer_metadata(reader.metadata(), opt);
  const auto& fields = optim::state_fields(kind);

  // Every optim/ key names a known parameter and field.
  std::set<std::string> known(all_names.begin(), all_names.end());
  for (const auto& key : reader.keys_with_prefix(kOptimPrefix)) {
    const auto slash = key.rfind('/');
    const std::string name = key.substr(std::string(kOptimPrefix).size(), slash - std::string(kOptimPrefix).size());
    const std::string field = key.substr(slash + 1);
    TORCH_CHECK(slash > std::string(kOptimPrefix).size() && known.count(name), "checkpoint: ", key,
                " is the optimizer state of a parameter the model does not have; the checkpoint was saved from "
                "another model");
    TORCH_CHECK(std::find(fields.begin(), fields.end(), field) != fields.end(), "checkpoint: ", key,
                " is not a state field of ", kind, "; the checkpoint is damaged or from another optimizer");
  }

  const std::vector<at::Tensor> params = pick(all_params, mine);
  optim::OptimizerStateDict dict = optim::state_dict_of(opt, params);  // the current group layout
  read_group_options(reader.metadata(), dict);
  for (size_t j = 0; j < mine.size(); ++j) {
    const std::string& name = all_names[mine[j]];
    const at::Tensor& p = params[j];
    optim::ParamStateDict entry;
    for (const auto& field : fields) {
      const std::string key = optim_key(name, field);
      if (!reader.has(key)) continue;
      if (field == "step") {
        const TensorInfo info = reader.info(key);
        TORCH_CHECK(info.numel() == 1, "checkpoint: ", key, " must hold one number but has shape ", shape_text(info.shape));
        entry.tensors[field] = reader.read(key).reshape({});
      } else if (pieces.piece) {
        const TensorInfo info = reader.info(key);
        const auto full = pieces.full_shape(name, p);
        TORCH_CHECK(info.shape == full && info.dtype == p.scalar_type(), "checkpoint: ", key, " has shape ",
                    shape_text(info.shape), " (", info.dtype, ") but parameter ", name, " is a piece of ",
                    shape_text(full), " (", p.scalar_type(), "); the checkpoint was saved from another model");
        entry.tensors[field] = pieces.piece(name, reader.read(key)).contiguous();
      } else {
        check_like(reader, key, p, "parameter " + name);
        entry.tensors[field] = reader.read(key);
      }
    }
    dict.params[j] = entry.tensors.empty() ? std::nullopt : std::optional<optim::ParamStateDict>(std::move(entry));
  }
  optim::load_state_dict_into(opt, params, dict);
}

std::vector<size_t> all_indices(size_t n) {
  std::vector<size_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = i;
  return out;
}

}  // namespace

void put_optimizer_metadata(Metadata& meta, const optim::OptimizerStateDict& dict) {
  put(meta, "optim/kind", dict.optimizer);
  put(meta, "optim/groups", static_cast<int64_t>(dict.groups.size()));
  for (size_t g = 0; g < dict.groups.size(); ++g) {
    for (const auto& [option, v] : dict.groups[g].options) put(meta, group_key(g, option), v);
  }
}

void check_optimizer_metadata(const Metadata& meta, const torch::optim::Optimizer& opt) {
  const std::string kind = optim::optimizer_kind(opt);
  const std::string saved_kind = get_string(meta, "optim/kind");  // a copy: GCC 14 flags the reference
  TORCH_CHECK(saved_kind == kind, "checkpoint: optim/kind is ", saved_kind, " in the checkpoint but the optimizer is ",
              kind, "; resume with the optimizer the checkpoint was saved with (e.g. --optimizer)");
  const int64_t groups = get_int(meta, "optim/groups");
  TORCH_CHECK(groups == static_cast<int64_t>(opt.param_groups().size()), "checkpoint: optim/groups is ", groups,
              " in the checkpoint but the optimizer has ", opt.param_groups().size(),
              " param group(s); build the optimizer with the same param groups");
}

void read_group_options(const Metadata& meta, optim::OptimizerStateDict& dict) {
  for (size_t g = 0; g < dict.groups.size(); ++g) {
    for (auto& [option, v] : dict.groups[g].options) v = get_double(meta, group_key(g, option));
  }
}

Snapshot& Snapshot::add(Snapshot other) {
  for (auto& p : other.pieces) pieces.push_back(std::move(p));
  for (auto& [k, v] : other.metadata) {
    auto [it, fresh] = metadata.emplace(k, v);
    TORCH_CHECK(fresh || it->second == v, "checkpoint: metadata key ", k, " is set twice, to \"", it->second,
                "\" and \"", v, "\"; give each part of the state its own keys");
  }
  return *this;
}

std::string model_key(const std::string& name) { return kModelPrefix + name; }
std::string optim_key(const std::string& param_name, const std::string& field) {
  return kOptimPrefix + param_name + "/" + field;
}
std::string rng_key(int rank) { return "rng/cpu/rank" + std::to_string(rank); }

std::vector<std::string> param_names(const torch::nn::Module& module, const std::vector<at::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, std::string> by_impl;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    by_impl.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = by_impl.find(params[i].unsafeGetTensorImpl());
    TORCH_CHECK(it != by_impl.end(), "checkpoint::param_names: parameter ", i, " (shape ", params[i].sizes(),
                ") is not a parameter of the module; pass the unwrapped model the optimizer was built over");
    out.push_back(it->second);
  }
  return out;
}

// ---- model ---------------------------------------------------------------------------------------

Snapshot snapshot_model(const torch::nn::Module& module, int rank, int world) {
  Snapshot s;
  for (const auto& [name, t] : named_tensors(module)) add_replicated(s, model_key(name), t, rank, world);
  return s;
}

void load_model(const Reader& reader, torch::nn::Module& module) { load_model(reader, module, Pieces{}); }

void load_model(const Reader& reader, torch::nn::Module& module, const Pieces& pieces) {
  const auto tensors = named_tensors(module);
  std::set<std::string> expected;
  for (const auto& [name, t] : tensors) {
    const std::string key = model_key(name);
    expected.insert(key);
    TORCH_CHECK(reader.has(key), "checkpoint: no key ", key, " in the checkpoint (it has ",
                reader.keys_with_prefix(kModelPrefix).size(),
                " model/ keys); the checkpoint was saved from another model (fewer layers?)");
    if (pieces.full_shape) {
      const TensorInfo info = reader.info(key);
      const auto full = pieces.full_shape(name, t);
      TORCH_CHECK(info.shape == full && info.dtype == t.scalar_type(), "checkpoint: ", key, " has shape ",
                  shape_text(info.shape), " (", info.dtype, ") but the model's ", name, " is a piece of ",
                  shape_text(full), " (", t.scalar_type(), "); the checkpoint was saved from another model");
    } else {
      check_like(reader, key, t, "the model's " + name);
    }
  }
  for (const auto& key : reader.keys_with_prefix(kModelPrefix)) {
    TORCH_CHECK(expected.count(key), "checkpoint: ", key, " is in the checkpoint but the model has no ",
                key.substr(std::string(kModelPrefix).size()),
                "; the checkpoint was saved from another model (more layers?)");
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : tensors) {
    at::Tensor dst = t;
    at::Tensor full = reader.read(model_key(name));
    dst.copy_(pieces.piece ? pieces.piece(name, full) : full);
  }
}

void check_model_keys(const Reader& reader, const ModelKeys& expected) {
  for (const auto& key : reader.keys_with_prefix(kModelPrefix)) {
    TORCH_CHECK(expected.count(key), "checkpoint: ", key, " is not a parameter or buffer of the model; the checkpoint "
                "was saved from another model (other layers?)");
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
}

// ---- optimizer -------------------------------------------------------------------------------------

Snapshot snapshot_optimizer(const torch::optim::Optimizer& opt, const std::vector<std::string>& names,
                            const std::vector<at::Tensor>& params, int rank, int world) {
  return optimizer_snapshot(optim::state_dict_view(opt, params), names, /*replicated=*/true, rank, world);
}

Snapshot snapshot_optimizer(optim::ShardedOptimizer& opt, const std::vector<std::string>& names) {
  TORCH_CHECK(names.size() == opt.params().size(), "checkpoint: ", names.size(), " parameter names for the ",
              opt.params().size(), " parameters of the ShardedOptimizer; name every one of params()");
  const auto& mine = opt.partition().by_rank[opt.process_group().rank()];
  std::vector<std::string> my_names;
  for (size_t i : mine) my_names.push_back(names[i]);
  return optimizer_snapshot(optim::state_dict_view(opt.local(), pick(opt.params(), mine)), my_names,
                            /*replicated=*/false, 0, 1);
}

void load_optimizer(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& names,
                    const std::vector<at::Tensor>& params) {
  load_optimizer_impl(reader, opt, names, params, all_indices(params.size()));
}

void load_optimizer(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& all_names,
                    const std::vector<at::Tensor>& all_params, const std::vector<size_t>& mine, const Pieces& pieces) {
  load_optimizer_impl(reader, opt, all_names, all_params, mine, pieces);
}

void load_optimizer(const Reader& reader, torch::optim::Optimizer& opt, const std::vector<std::string>& names,
                    const std::vector<at::Tensor>& params, const Pieces& pieces) {
  load_optimizer_impl(reader, opt, names, params, all_indices(params.size()), pieces);
}

Snapshot snapshot_optimizer(const optim::OptimizerStateDict& dict, const std::vector<std::string>& names, int rank,
                            int world) {
  return optimizer_snapshot(dict, names, /*replicated=*/true, rank, world);
}

void load_optimizer(const Reader& reader, optim::ShardedOptimizer& opt, const std::vector<std::string>& names) {
  load_optimizer_impl(reader, opt.local(), names, opt.params(), opt.partition().by_rank[opt.process_group().rank()]);
}

// ---- random state -------------------------------------------------------------------------------------

Snapshot snapshot_rng(int rank) {
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  Snapshot s;
  s.pieces.push_back(whole_piece(rng_key(rank), state));
  return s;
}

void load_rng(const Reader& reader, int rank) {
  std::string key = rng_key(rank);
  if (!reader.has(key)) key = rng_key(0);
  TORCH_CHECK(reader.has(key), "checkpoint: no random state for rank ", rank, " (neither ", rng_key(rank), " nor ",
              key, "); the checkpoint was saved without snapshot_rng");
  at::Tensor state = reader.read(key);
  TORCH_CHECK(state.scalar_type() == at::kByte && state.dim() == 1, "checkpoint: ", key,
              " must be a 1-D uint8 generator state, got ", state.scalar_type(), " of shape ", state.sizes());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(state);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "checkpoint: ", key, " is not a CPU generator state: ", e.what_without_backtrace());
  }
}

// ---- small values ---------------------------------------------------------------------------------------

void put(Metadata& meta, const std::string& key, int64_t value) { meta[key] = std::to_string(value); }
void put(Metadata& meta, const std::string& key, double value) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  meta[key] = buf;
}
void put(Metadata& meta, const std::string& key, const std::string& value) { meta[key] = value; }

const std::string& get_string(const Metadata& meta, const std::string& key) {
  auto it = meta.find(key);
  TORCH_CHECK(it != meta.end(), "checkpoint: no metadata key ", key,
              " in the checkpoint; it was saved without this part of the training state");
  return it->second;
}

int64_t get_int(const Metadata& meta, const std::string& key) {
  const std::string& v = get_string(meta, key);
  auto x = util::parse_int(v);
  TORCH_CHECK(x, "checkpoint: metadata ", key, " must be an integer, got \"", v, "\"");
  return *x;
}

double get_double(const Metadata& meta, const std::string& key) {
  const std::string& v = get_string(meta, key);
  auto x = util::parse_double(v);
  TORCH_CHECK(x, "checkpoint: metadata ", key, " must be a finite number, got \"", v, "\"");
  return *x;
}

void put_grad_scaler_state(Metadata& meta, const amp::GradScalerState& state) {
  put(meta, "amp/scale", state.scale);
  put(meta, "amp/growth_tracker", state.growth_tracker);
}

amp::GradScalerState grad_scaler_state(const Metadata& meta) {
  amp::GradScalerState s;
  s.scale = get_double(meta, "amp/scale");
  s.growth_tracker = get_int(meta, "amp/growth_tracker");
  TORCH_CHECK(s.scale > 0, "checkpoint: metadata amp/scale must be > 0, got ", s.scale);
  TORCH_CHECK(s.growth_tracker >= 0, "checkpoint: metadata amp/growth_tracker must be >= 0, got ", s.growth_tracker);
  return s;
}

}  // namespace dtrain::checkpoint
