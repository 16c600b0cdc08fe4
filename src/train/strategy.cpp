#include "dtrain/train/strategy.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/broadcast.h"
#include "dtrain/fsdp/train_state.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/optim/state_dict.h"
#include "dtrain/tensor_parallel/sharded.h"
#include "dtrain/train/checkpointing.h"
#include "dtrain/train/session.h"

namespace dtrain::train {

std::pair<double, double> Strategy::param_sums() {
  double checksum = 0, sq = 0;
  for (const auto& p : model_->parameters()) {
    auto d = p.detach().to(at::kDouble);
    checksum += d.sum().item<double>();
    sq += d.pow(2).sum().item<double>();
  }
  return {checksum, sq};
}

std::string Strategy::export_weights(const std::string& path) {
  return pg_.rank() == 0 ? export_module_weights(*model_, path) : "";
}

namespace detail {

std::pair<double, double> sums_over(const comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors) {
  double sums[2] = {0, 0};
  for (const auto& t : tensors) {
    auto d = t.detach().to(at::kDouble);
    sums[0] += d.sum().item<double>();
    sums[1] += d.pow(2).sum().item<double>();
  }
  auto t = at::tensor(std::vector<double>{sums[0], sums[1]}, at::kDouble).to(group.device());
  comm::all_reduce(group, t);
  t = t.to(at::kCPU);
  return {t[0].item<double>(), t[1].item<double>()};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& cfg, const ModelHooks& hooks,
                                                        std::vector<torch::optim::OptimizerParamGroup> groups) {
  if (hooks.optimizer) return hooks.optimizer(std::move(groups));
  if (cfg.optimizer == "sgd") {
    return std::make_unique<torch::optim::SGD>(std::move(groups), torch::optim::SGDOptions(cfg.lr).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(cfg.lr).weight_decay(0.01));
}

int64_t data_parallel_devices(const TrainConfig& cfg) {
  const int64_t gpus = cfg.device == "cuda" ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  if (gpus < 2) {
    std::printf("%s: --strategy dp spreads each batch over the GPUs of this process, and %s: training as "
                "--strategy single\n",
                cfg.program.c_str(), cfg.device == "cuda" ? "only one is visible" : "--device is cpu");
    std::fflush(stdout);
  }
  return gpus;
}

void check_replicable(const torch::nn::Module& model, const TrainConfig& cfg) {
  if (cfg.activation_checkpointing) {
    throw std::invalid_argument("--strategy dp replicates the model at every forward and the replicas carry no "
                                "recomputation hooks: drop --activation-checkpointing, or use --strategy ddp");
  }
  try {
    (void)model.clone();
  } catch (const c10::Error& e) {
    throw std::invalid_argument("--strategy dp replicates the model with clone(), which " + model.name() +
                                " does not have: derive it from torch::nn::Cloneable<" + model.name() +
                                "> (and implement reset()), or use --strategy ddp");
  }
}

void check_strategy(const TrainConfig& cfg, const comm::ProcessGroup& pg, const ModelHooks& hooks) {
  if (cfg.strategy == "auto") {
    throw std::invalid_argument("--strategy auto is resolved by train::fit's memory planner; before make_parallel, call "
                                "train::plan_strategy (train/planner.h) and use the configuration it returns");
  }
  if (cfg.strategy == "dp" && pg.size() != 1) {
    throw std::invalid_argument("--strategy dp is one process over all local GPUs (DataParallel), but WORLD_SIZE is " +
                                std::to_string(pg.size()) + ": run it without a launcher, or use --strategy ddp");
  }
  if (cfg.pp > 1 && pg.size() % cfg.pp != 0) {
    throw std::invalid_argument("--pp " + std::to_string(cfg.pp) + " must divide the world size (" +
                                std::to_string(pg.size()) + " ranks): the ranks are pipeline x data parallel");
  }
  if (cfg.pp > 1 && cfg.strategy == "single" && pg.size() != cfg.pp * cfg.tp) {
    throw std::invalid_argument("--strategy single --pp " + std::to_string(cfg.pp) +
                                (cfg.tp > 1 ? " --tp " + std::to_string(cfg.tp) : std::string()) +
                                " runs one pipeline, but WORLD_SIZE is " + std::to_string(pg.size()) +
                                ": use --strategy ddp for data parallelism around the stages");
  }
  if (cfg.tp > 1 && pg.size() % cfg.tp != 0) {
    throw std::invalid_argument("--tp " + std::to_string(cfg.tp) + " must divide the world size (" +
                                std::to_string(pg.size()) + " ranks): the ranks are data parallel x tensor parallel");
  }
  if (cfg.tp > 1 && cfg.pp == 1 && cfg.strategy == "single" && pg.size() != cfg.tp) {
    throw std::invalid_argument("--strategy single --tp " + std::to_string(cfg.tp) + " is one tensor-parallel group, but "
                                "WORLD_SIZE is " + std::to_string(pg.size()) + ": use --strategy ddp around it");
  }
  if (cfg.pp > 1 && !hooks.stages) {
    throw std::invalid_argument("--pp needs the program to say how its model is cut into stages (ModelHooks::stages; a "
                                "torch::nn::Sequential is cut at its children by default)");
  }
  if (cfg.pp == 1 && cfg.tp == 1 && cfg.strategy == "single" && pg.size() != 1) {
    throw std::invalid_argument("--strategy single trains in one process, but WORLD_SIZE is " +
                                std::to_string(pg.size()) + ": use --strategy ddp, or run without a launcher");
  }
  if (cfg.fsdp() && cfg.pp == 1 && cfg.wrap == "layer" && !hooks.wrap.fn) {
    throw std::invalid_argument("--wrap layer needs the program to say which modules are its layers "
                                "(ModelHooks::wrap, e.g. fsdp::WrapPolicy::by_type<Block>()); use --wrap none for one "
                                "unit");
  }
  if (cfg.activation_checkpointing && !hooks.recompute) {
    throw std::invalid_argument("--activation-checkpointing needs the program to say which modules to recompute "
                                "(ModelHooks::recompute, e.g. recompute::of_type<Block>())");
  }
  if (cfg.init_on_ranks && !hooks.param_init) {
    throw std::invalid_argument("--init-on-ranks needs the program's parameter initialiser (ModelHooks::param_init)");
  }
}

parallel::Layout layout_for(const TrainConfig& cfg, int world) {
  if (cfg.tp > 1 && cfg.pp > 1) {  // pipeline outermost, tensor innermost; ddp or single around the stages
    if (world % (cfg.tp * cfg.pp) != 0) {
      throw std::invalid_argument("--tp " + std::to_string(cfg.tp) + " x --pp " + std::to_string(cfg.pp) +
                                  " must divide the world size (" + std::to_string(world) +
                                  " ranks): the ranks are pipeline x data parallel x tensor parallel");
    }
    parallel::Layout l{cfg.strategy == "ddp" ? world / (cfg.tp * cfg.pp) : 1, 1, cfg.pp, cfg.tp};
    l.validate(world);
    return l;
  }
  if (cfg.tp > 1) {  // tensor innermost; ddp or single around it
    if (world % cfg.tp != 0) {
      throw std::invalid_argument("--tp " + std::to_string(cfg.tp) + " must divide the world size (" +
                                  std::to_string(world) + " ranks): the ranks are data parallel x tensor parallel");
    }
    const int d = world / cfg.tp;  // the data-parallel ranks of each tensor rank
    parallel::Layout l{cfg.strategy == "ddp" ? d : 1, 1, 1, cfg.tp};
    if (cfg.fsdp()) {
      try {
        // (hsdp's default shard group: this node's data-parallel ranks, LOCAL_WORLD_SIZE / tp)
        int shard = cfg.shard_size;
        if (shard == 0 && cfg.strategy == "hsdp") {
          const char* local = std::getenv("LOCAL_WORLD_SIZE");
          const int per_node = local ? std::atoi(local) : world;
          shard = per_node % cfg.tp == 0 ? std::max(1, per_node / cfg.tp) : 0;
        }
        l = fsdp::layout_for(fsdp::parse_sharding(cfg.sharding), d, {0, shard});
      } catch (const c10::Error& e) {
        throw std::invalid_argument("--strategy " + cfg.strategy + " --tp " + std::to_string(cfg.tp) + " --sharding " +
                                    cfg.sharding + (cfg.shard_size > 0 ? " --shard-size " + std::to_string(cfg.shard_size) : "") +
                                    " over the " + std::to_string(d) + " data-parallel ranks: " + e.what_without_backtrace());
      }
      l.tensor = cfg.tp;
    }
    l.validate(world);
    return l;
  }
  if (cfg.pp > 1) {  // pipeline outermost (check_strategy: pp divides world); around each stage
    const int d = world / cfg.pp;  // ddp replicates, zero1 and fsdp shard over the d ranks
    parallel::Layout l = cfg.strategy == "ddp" ? parallel::Layout{d, 1, cfg.pp} : parallel::Layout{1, d, cfg.pp};
    l.validate(world);
    return l;
  }
  if (cfg.strategy == "single" || cfg.strategy == "dp") return {1, 1};  // (check_strategy: world is 1)
  if (cfg.strategy == "ddp") return {world, 1};
  if (cfg.strategy == "zero1" || cfg.strategy == "zero2") return {1, world};
  try {
    return fsdp::layout_for(fsdp::parse_sharding(cfg.sharding), world, {0, cfg.shard_size});
  } catch (const c10::Error& e) {
    throw std::invalid_argument("--strategy " + cfg.strategy + " --sharding " + cfg.sharding +
                                (cfg.shard_size > 0 ? " --shard-size " + std::to_string(cfg.shard_size) : "") + ": " +
                                e.what_without_backtrace());
  }
}

fsdp::FullyShardedOptions fsdp_options(const TrainConfig& cfg, const ModelHooks& hooks) {
  auto opts = fsdp::FullyShardedOptions().sharding(fsdp::parse_sharding(cfg.sharding));
  if (cfg.wrap == "layer") opts.wrap_policy(hooks.wrap);
  if (cfg.shard_size > 0) opts.hybrid_layout(fsdp::MeshLayout{0, cfg.shard_size});
  if (!cfg.backward_prefetch.empty()) opts.backward_prefetch(fsdp::parse_backward_prefetch(cfg.backward_prefetch));
  if (!cfg.overlap_reduction.empty()) opts.overlap_reduction(cfg.overlap_reduction == "on");
  if (cfg.max_gathered_units > 0) opts.max_gathered_units(cfg.max_gathered_units);
  if (cfg.precision != "fp32") {
    // bf16 or fp16: gathered parameters (so forward and backward) in that dtype, gradients reduced
    // in fp32 (Design note [fp32 reduction], session.h), outputs returned in fp32.
    opts.mixed_precision(fsdp::MixedPrecision().param_dtype(compute_dtype(cfg)).reduce_dtype(at::kFloat)
                             .output_dtype(at::kFloat));
  }
  // Master shards, gradients and optimizer state on the CPU; a no-op for a model on the CPU.
  opts.cpu_offload(cfg.cpu_offload);
  if (cfg.init_on_ranks) opts.param_init_fn(hooks.param_init);
  return opts;
}

// --- Replicated ----------------------------------------------------------------------------------

Replicated::Replicated(std::shared_ptr<torch::nn::Module> model, const comm::ProcessGroup& pg, const TrainConfig& cfg,
                       const ModelHooks& hooks)
    : Strategy(std::move(model), pg),
      optimizer_(make_optimizer(cfg, hooks, {torch::optim::OptimizerParamGroup(model_->parameters())})) {}

double Replicated::clip_grad_norm(double max_norm) {
  return torch::nn::utils::clip_grad_norm_(model_->parameters(), max_norm);
}

int64_t Replicated::optimizer_state_bytes() { return optim::state_bytes(*optimizer_); }

// Replicated state: each rank writes 1/W of the model and of the optimizer state.
checkpoint::Snapshot Replicated::state_snapshot() {
  const auto params = model_->parameters();
  return checkpoint::snapshot_model(*model_, pg_.rank(), pg_.size())
      .add(checkpoint::snapshot_optimizer(*optimizer_, checkpoint::param_names(*model_, params), params, pg_.rank(),
                                          pg_.size()));
}

void Replicated::load_state(const checkpoint::Reader& reader) {
  const auto params = model_->parameters();
  checkpoint::load_model(reader, *model_);
  checkpoint::load_optimizer(reader, *optimizer_, checkpoint::param_names(*model_, params), params);
}

// --- Sharded -------------------------------------------------------------------------------------

Sharded::Sharded(std::shared_ptr<torch::nn::Module> model, const comm::ProcessGroup& pg, const TrainConfig& cfg,
                 const ModelHooks& hooks)
    : Strategy(std::move(model), pg),
      optimizer_({torch::optim::OptimizerParamGroup(model_->parameters())}, pg,
                 [cfg, hooks](std::vector<torch::optim::OptimizerParamGroup> g) {
                   return make_optimizer(cfg, hooks, std::move(g));
                 }) {}

double Sharded::clip_grad_norm(double max_norm) { return optim::clip_grad_norm(optimizer_, max_norm); }

// zero1 holds every gradient (DDP) but steps only its own; zero2 holds only its own.
std::vector<at::Tensor> Sharded::grads_held() {
  std::vector<at::Tensor> owned;
  for (size_t i : optimizer_.partition().by_rank[pg_.rank()]) owned.push_back(optimizer_.params()[i]);
  return owned;
}

int64_t Sharded::optimizer_state_bytes() { return optim::state_bytes(optimizer_.local()); }

// The model split among the ranks; each owner writes its parameters' optimizer state whole.
// Loading reads the state of the parameters this rank owns now (any saved world size).
checkpoint::Snapshot Sharded::state_snapshot() {
  return checkpoint::snapshot_model(*model_, pg_.rank(), pg_.size())
      .add(checkpoint::snapshot_optimizer(optimizer_, checkpoint::param_names(*model_, optimizer_.params())));
}

void Sharded::load_state(const checkpoint::Reader& reader) {
  checkpoint::load_model(reader, *model_);
  checkpoint::load_optimizer(reader, optimizer_, checkpoint::param_names(*model_, optimizer_.params()));
}

// --- FullySharded --------------------------------------------------------------------------------

FullySharded::FullySharded(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state,
                           std::vector<at::Tensor> shards, const comm::ProcessGroup& pg, const TrainConfig& cfg,
                           const ModelHooks& hooks)
    : Strategy(std::move(model), pg), state_(state), shards_(std::move(shards)) {
  optimizer_ = make_optimizer(cfg, hooks, {torch::optim::OptimizerParamGroup(shards_)});
}

std::shared_ptr<void> FullySharded::no_sync() {
  return std::make_shared<fsdp::FullyShardedState::NoSyncGuard>(state_.no_sync());
}

int64_t FullySharded::optimizer_state_bytes() { return optim::state_bytes(*optimizer_); }

std::pair<double, double> FullySharded::param_sums() {
  // Padding in the shards is zero; every element is held once per shard group.
  return sums_over(state_.groups().shard, state_.shards());
}

checkpoint::Snapshot FullySharded::state_snapshot() {
  return fsdp::snapshot_model(state_).add(fsdp::snapshot_optimizer(state_, *optimizer_));
}

void FullySharded::load_state(const checkpoint::Reader& reader) {
  fsdp::load_model(reader, state_);
  fsdp::load_optimizer(reader, state_, *optimizer_);
}

namespace {
// Tensor parallelism: the full tensors of `named` (pieces cut by `plan`; collective over its group),
// `buffers` and the optimizer's state of `named`, each of `writers` ranks writing 1/writers of each.
checkpoint::Snapshot full_tensor_snapshot(const tensor_parallel::Plan& plan,
                                          const std::vector<std::pair<std::string, at::Tensor>>& named,
                                          const std::vector<std::pair<std::string, at::Tensor>>& buffers,
                                          const torch::optim::Optimizer& opt, int writer, int writers) {
  checkpoint::Snapshot s;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : named) {
    names.push_back(name);
    params.push_back(p);
    if (auto piece = checkpoint::replicated_piece(checkpoint::model_key(name), plan.full(name, p), writer, writers)) {
      s.pieces.push_back(std::move(*piece));
    }
  }
  for (const auto& [name, b] : buffers) {
    if (auto piece = checkpoint::replicated_piece(checkpoint::model_key(name), b.detach(), writer, writers)) {
      s.pieces.push_back(std::move(*piece));
    }
  }
  optim::OptimizerStateDict dict = optim::state_dict_of(opt, params);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!dict.params[i]) continue;
    for (auto& [field, t] : dict.params[i]->tensors) {
      if (plan.is_cut(names[i]) && t.sizes() == params[i].sizes()) t = plan.full(names[i], t);
    }
  }
  return s.add(checkpoint::snapshot_optimizer(dict, names, writer, writers));
}

checkpoint::Pieces pieces_of(const tensor_parallel::Plan& plan) {
  checkpoint::Pieces pieces;
  pieces.full_shape = [plan](const std::string& name, const at::Tensor& local) {
    return plan.full_shape(name, local.sizes().vec());
  };
  pieces.piece = [plan](const std::string& name, const at::Tensor& full) { return plan.piece(name, full); };
  return pieces;
}

std::vector<std::pair<std::string, at::Tensor>> named_buffers(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& b : m.named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

// Each parameter of `model` once, under its first name (tied names share a tensor).
std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  }
  return out;
}
}  // namespace

// --- Pipelined -----------------------------------------------------------------------------------

namespace {
Pipelined::Around around_of(const TrainConfig& cfg) {
  if (cfg.strategy == "zero1") return Pipelined::Around::ZeRO1;
  if (cfg.strategy == "fsdp") return Pipelined::Around::FullyShard;
  return Pipelined::Around::Replicated;
}
}  // namespace

Pipelined::Pipelined(std::shared_ptr<torch::nn::Module> model, std::vector<pipeline::Stage> stages,
                     const parallel::Groups& groups, const TrainConfig& cfg, const ModelHooks& hooks)
    : Strategy(std::move(model), groups.world), around_(around_of(cfg)), groups_(groups) {
  if (!hooks.loss) throw std::invalid_argument("--pp needs the loss of the last stage (ModelHooks::loss)");
  if (around_ == Around::FullyShard) {
    // A stage's first forward of a step gathers this rank's stages (Design note [sharded stages]).
    for (auto& stage : stages) {
      stage.forward = [this, f = std::move(stage.forward)](const at::Tensor& x) {
        sharded_->gather();
        return f(x);
      };
    }
  }
  pipeline_ = std::make_unique<pipeline::Pipeline>(
      std::move(stages), groups.pipeline, hooks.loss,
      pipeline::PipelineOptions().schedule(cfg.schedule).microbatches(cfg.microbatches).virtual_stages(cfg.virtual_stages));
  // A stage's data-parallel replicas start from data rank 0's values (as DDP's broadcast).
  for (auto& p : pipeline_->parameters()) {
    at::Tensor t = p.detach();
    if (groups_.data.size() > 1) comm::broadcast(groups_.data, t, comm::BroadcastOptions().src(0));
  }
  auto make = [cfg, hooks](std::vector<torch::optim::OptimizerParamGroup> g) { return make_optimizer(cfg, hooks, std::move(g)); };
  switch (around_) {
    case Around::Replicated:
      optimizer_ = make({torch::optim::OptimizerParamGroup(pipeline_->parameters())});
      break;
    case Around::ZeRO1:
      zero_ = std::make_unique<optim::ShardedOptimizer>(
          std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(pipeline_->parameters())},
          groups_.data, make);
      break;
    case Around::FullyShard:
      sharded_ = std::make_unique<pipeline::ShardedStages>(pipeline_->stages(), groups_);
      optimizer_ = make({torch::optim::OptimizerParamGroup(sharded_->trainable_shards())});
      break;
  }
  if (groups_.tensor.size() > 1) {
    plan_ = tensor_parallel::Plan::of(*model_, groups_.tensor);
    for (const auto& [name, p] : pipeline_->named_parameters()) {  // (one replica of each stage counts)
      if (groups_.data.rank() == 0 && plan_->counts(name)) counted_.push_back(p);
    }
  }
  // Design note [a rank keeps its stages]: every rank built the whole model (a libtorch module
  // cannot be built without its values); the other ranks' stages' parameters are released now.
  std::unordered_set<const void*> local;
  for (const auto& p : pipeline_->parameters()) local.insert(p.unsafeGetTensorImpl());
  for (const auto& p : model_->parameters()) {
    if (!local.count(p.unsafeGetTensorImpl())) others_.push_back({p, p.sizes().vec()});
  }
  release_others();
}

void Pipelined::materialize_others() {
  at::NoGradGuard no_grad;
  for (auto& [p, shape] : others_) {
    if (p.numel() == 0 && c10::multiply_integers(shape) > 0) p.set_data(at::zeros(shape, p.options()));
  }
}

void Pipelined::release_others() {
  at::NoGradGuard no_grad;
  for (auto& [p, shape] : others_) p.set_data(at::empty({0}, p.options()));
}

void Pipelined::zero_grad() {
  if (sharded_) sharded_->reshard();  // (after a skipped step the stages are still gathered)
  if (zero_) {
    zero_->zero_grad();  // every parameter's gradient, not only the owned ones (all are all-reduced)
  } else {
    compat::zero_grad_in_place(*optimizer_);
  }
}

void Pipelined::step() {
  if (zero_) {
    zero_->step();  // each owner steps its parameters and broadcasts them over the data group
  } else {
    optimizer_->step();
  }
  if (sharded_) sharded_->reshard();
}

void Pipelined::after_backward() {
  if (sharded_) {
    sharded_->reduce_gradients();
  } else {
    pipeline::average_gradients(pipeline_->parameters(), groups_.data);
  }
}

std::vector<at::Tensor> Pipelined::grads_held() {
  switch (around_) {
    case Around::ZeRO1: {
      std::vector<at::Tensor> owned;
      for (size_t i : zero_->partition().by_rank[groups_.data.rank()]) owned.push_back(zero_->params()[i]);
      return owned;
    }
    case Around::FullyShard:
      return sharded_->trainable_shards();
    case Around::Replicated:
      break;
  }
  return pipeline_->parameters();
}

double Pipelined::clip_grad_norm(double max_norm) {
  // Every gradient element once: the pipeline group holds one replica of every stage; with zero1
  // and fsdp the data-parallel ranks of a stage hold disjoint parts of it, so the world counts.
  if (plan_) return optim::clip_grad_norm(groups_.world, counted_, pipeline_->parameters(), max_norm);
  if (around_ == Around::Replicated) return optim::clip_grad_norm(groups_.pipeline, pipeline_->parameters(), max_norm);
  return optim::clip_grad_norm(groups_.world, grads_held(), max_norm);
}

int64_t Pipelined::optimizer_state_bytes() { return optim::state_bytes(optimizer()); }

torch::optim::Optimizer& Pipelined::optimizer() { return zero_ ? zero_->local() : *optimizer_; }

checkpoint::Snapshot Pipelined::state_snapshot() {
  const int d = groups_.data.rank(), dd = groups_.data.size();
  checkpoint::Snapshot s;
  if (sharded_) {  // each stage's parameters and optimizer state as the shards hold them; buffers 1/D each
    const fsdp::ShardView view = sharded_->view();
    s.pieces = fsdp::snapshot_params(view);
    for (const auto& stage : pipeline_->stages()) {
      for (const auto& b : stage.module->named_buffers()) {
        if (auto p = checkpoint::replicated_piece(checkpoint::model_key(b.key()), b.value().detach(), d, dd)) s.pieces.push_back(*p);
      }
    }
    return s.add(fsdp::snapshot_optimizer(view, *optimizer_));
  }
  if (plan_) {  // full tensors (gathered over the tensor group), 1/(D x T) by each rank of the stage
    std::vector<std::pair<std::string, at::Tensor>> buffers;
    for (const auto& stage : pipeline_->stages()) {
      for (const auto& b : named_buffers(*stage.module)) buffers.push_back(b);
    }
    const int t = groups_.tensor.rank(), tt = groups_.tensor.size();
    return full_tensor_snapshot(*plan_, pipeline_->named_parameters(), buffers, *optimizer_, d * tt + t, dd * tt);
  }
  for (const auto& stage : pipeline_->stages()) s.add(checkpoint::snapshot_model(*stage.module, d, dd));
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (auto& [name, p] : pipeline_->named_parameters()) {
    names.push_back(name);
    params.push_back(p);
  }
  if (zero_) return s.add(checkpoint::snapshot_optimizer(*zero_, names));  // (zero_'s params are these, in order)
  return s.add(checkpoint::snapshot_optimizer(*optimizer_, names, params, d, dd));
}

void Pipelined::load_state(const checkpoint::Reader& reader) {
  // The whole model, every key checked against it (the other stages' values are read and dropped).
  if (sharded_) sharded_->gather();
  materialize_others();
  const checkpoint::Pieces pieces = plan_ ? pieces_of(*plan_) : checkpoint::Pieces{};
  checkpoint::load_model(reader, *model_, pieces);
  release_others();
  if (sharded_) {
    sharded_->store_gathered_values();
    sharded_->reshard();
    fsdp::load_optimizer(reader, sharded_->view(), *optimizer_);
    return;
  }
  std::vector<std::string> all_names;
  std::vector<at::Tensor> all_params;
  std::unordered_map<const void*, size_t> index;
  for (const auto& item : model_->named_parameters()) {
    index.emplace(item.value().unsafeGetTensorImpl(), all_params.size());
    all_names.push_back(item.key());
    all_params.push_back(item.value());
  }
  auto index_of = [&](const at::Tensor& p) {
    auto it = index.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != index.end(), "pipeline: a stage parameter is not a parameter of the model");
    return it->second;
  };
  std::vector<size_t> mine;  // in the optimizer's order
  if (zero_) {
    for (size_t i : zero_->partition().by_rank[groups_.data.rank()]) mine.push_back(index_of(zero_->params()[i]));
  } else {
    for (const auto& p : pipeline_->parameters()) mine.push_back(index_of(p));
  }
  checkpoint::load_optimizer(reader, optimizer(), all_names, all_params, mine, pieces);
}

bool Pipelined::gather_whole_model() {
  const bool gathered_here = sharded_ && sharded_->state() == pipeline::ShardedStages::State::Sharded;
  if (sharded_) sharded_->gather();
  materialize_others();
  std::unordered_set<const void*> local;
  for (const auto& p : pipeline_->parameters()) local.insert(p.unsafeGetTensorImpl());
  auto params = model_->parameters();
  // One replica of each stage (data rank 0) contributes; with tensor parallelism one all-reduce per
  // tensor rank, kept by that rank's ranks (their pieces).
  const int tensor_ranks = groups_.tensor.size();
  for (int r = 0; r < tensor_ranks && !params.empty(); ++r) {
    const bool contributes = groups_.data.rank() == 0 && groups_.tensor.rank() == r;
    std::vector<at::Tensor> parts;
    for (const auto& p : params) {
      const bool mine = local.count(p.unsafeGetTensorImpl()) > 0;
      parts.push_back(mine && contributes ? p.detach().reshape({-1}).to(at::kFloat)
                                          : at::zeros({p.numel()}, p.options().dtype(at::kFloat)));
    }
    at::Tensor flat = at::cat(parts).to(pg_.device());
    comm::all_reduce(pg_, flat);  // x + 0 + ... + 0 = x: exact
    if (groups_.tensor.rank() != r) continue;
    flat = flat.to(at::kCPU);
    int64_t at = 0;
    at::NoGradGuard no_grad;
    for (auto& p : params) {
      p.detach().copy_(flat.narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  }
  return gathered_here;
}

std::pair<double, double> Pipelined::param_sums() {
  // Each element once over the world, summed where it lives (no rank holds the whole model):
  // fsdp's shards (padding is zero) on every rank, else the stages on data-parallel rank 0.
  std::vector<at::Tensor> mine;
  if (sharded_) {
    mine = sharded_->trainable_shards();
  } else if (plan_) {
    mine = counted_;
  } else if (groups_.data.rank() == 0) {
    mine = pipeline_->parameters();
  }
  return sums_over(pg_, mine);
}

std::string Pipelined::export_weights(const std::string& path) {
  const bool gathered_here = gather_whole_model();
  std::string out;
  if (plan_) {  // the full tensors (collective over the tensor group)
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& [name, p] : unique_named_parameters(*model_)) tensors.emplace_back(name, plan_->full(name, p));
    for (const auto& b : named_buffers(*model_)) tensors.push_back(b);
    if (pg_.rank() == 0) out = export_named_weights(tensors, path);
  } else {
    out = Strategy::export_weights(path);
  }
  release_others();
  if (gathered_here) sharded_->reshard();
  return out;
}

// --- TensorParallel ------------------------------------------------------------------------------

TensorParallel::TensorParallel(std::shared_ptr<torch::nn::Module> model, const parallel::Groups& groups,
                               const TrainConfig& cfg, const ModelHooks& hooks)
    : Replicated(std::move(model), groups.world, cfg, hooks),
      groups_(groups),
      plan_(tensor_parallel::Plan::of(*model_, groups.tensor)) {
  for (const auto& [name, p] : unique_named_parameters(*model_)) {
    if (plan_.counts(name)) counted_.push_back(p);
  }
}

double TensorParallel::clip_grad_norm(double max_norm) {
  // Every element once over the tensor group (data-parallel replicas hold equal gradients after
  // DDP); every gradient scaled.
  return optim::clip_grad_norm(groups_.tensor, counted_, model_->parameters(), max_norm);
}

checkpoint::Snapshot TensorParallel::state_snapshot() {
  return full_tensor_snapshot(plan_, unique_named_parameters(*model_), named_buffers(*model_), *optimizer_, pg_.rank(), pg_.size());
}

void TensorParallel::load_state(const checkpoint::Reader& reader) {
  const checkpoint::Pieces pieces = pieces_of(plan_);
  checkpoint::load_model(reader, *model_, pieces);
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : unique_named_parameters(*model_)) {
    names.push_back(name);
    params.push_back(p);
  }
  checkpoint::load_optimizer(reader, *optimizer_, names, params, pieces);
}

std::pair<double, double> TensorParallel::param_sums() { return sums_over(groups_.tensor, counted_); }

std::string TensorParallel::export_weights(const std::string& path) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, p] : unique_named_parameters(*model_)) tensors.emplace_back(name, plan_.full(name, p));
  for (const auto& b : model_->named_buffers()) tensors.emplace_back(b.key(), b.value().detach());
  return pg_.rank() == 0 ? export_named_weights(tensors, path) : "";
}

// --- TensorParallelSharded -----------------------------------------------------------------------

TensorParallelSharded::TensorParallelSharded(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state,
                                             std::vector<at::Tensor> shards, const parallel::Groups& groups,
                                             const TrainConfig& cfg, const ModelHooks& hooks)
    : FullySharded(std::move(model), state, std::move(shards), groups.world, cfg, hooks),
      groups_(groups),
      plan_(tensor_parallel::Plan::of(*model_, groups.tensor)),
      counted_ranges_(ranges_counted()) {}

fsdp::ShardView TensorParallelSharded::view(bool writing) const {
  return tensor_parallel::full_view(fsdp::shard_view(state_), plan_, writing);
}

std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> TensorParallelSharded::ranges_counted() const {
  // The first replica's ranges of cut parameters, and of whole ones on tensor rank 0 (each element
  // once over the world), in the shards' own coordinates (no split into runs); a tied parameter's
  // range (listed under each of its names) once.
  const fsdp::ShardView v = fsdp::shard_view(state_);
  std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> out;
  if (!v.writes) return out;
  std::set<std::pair<size_t, int64_t>> seen;
  for (const auto& sl : v.slices) {
    if (!plan_.counts(sl.name)) continue;
    if (!seen.insert({sl.flat, sl.shard_offset}).second) continue;
    out.push_back({sl.flat, {sl.shard_offset, sl.count}});
  }
  return out;
}

double TensorParallelSharded::clip_grad_norm(double max_norm) {
  // Counted: counted_ranges_ of the gradients; scaled: every shard.
  std::vector<at::Tensor> counted, scaled;
  const auto shards = state_.shards();
  for (const auto& [flat, range] : counted_ranges_) {
    const at::Tensor& g = shards[flat].grad();
    if (g.defined()) counted.push_back(g.narrow(0, range.first, range.second));
  }
  for (const auto& t : shards_) {
    if (t.grad().defined()) scaled.push_back(t.grad());
  }
  return optim::clip_grads(groups_.world, counted, scaled, max_norm);
}

std::pair<double, double> TensorParallelSharded::param_sums() {
  std::vector<at::Tensor> mine;
  const auto shards = state_.shards();
  for (const auto& [flat, range] : counted_ranges_) mine.push_back(shards[flat].narrow(0, range.first, range.second));
  return sums_over(groups_.world, mine);
}

checkpoint::Snapshot TensorParallelSharded::state_snapshot() {
  const fsdp::ShardView v = view(true);
  checkpoint::Snapshot s;
  s.pieces = fsdp::snapshot_params(v);
  if (groups_.tensor.rank() == 0) {  // buffers are whole: tensor rank 0's data-parallel ranks write 1/D each
    for (const auto& [name, b] : state_.buffers()) {
      if (auto p = checkpoint::replicated_piece(checkpoint::model_key(name), b.detach(), groups_.data.rank(),
                                                groups_.data.size())) {
        s.pieces.push_back(std::move(*p));
      }
    }
  }
  return s.add(fsdp::snapshot_optimizer(v, *optimizer_));
}

void TensorParallelSharded::load_state(const checkpoint::Reader& reader) {
  tensor_parallel::load_model(reader, state_, plan_);
  fsdp::load_optimizer(reader, view(false), *optimizer_);
}

std::string TensorParallelSharded::export_weights(const std::string& path) {
  // Data-parallel rank 0 of every tensor rank gets its pieces whole (one unit at a time), then the
  // full tensors over its tensor group (those ranks make one).
  const auto dict = state_.full_state_dict(0);
  if (dict.is_empty()) return "";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, p] : unique_named_parameters(*model_)) tensors.emplace_back(name, plan_.full(name, dict[name]));
  for (const auto& [name, b] : state_.buffers()) tensors.emplace_back(name, dict[name]);
  return pg_.rank() == 0 ? export_named_weights(tensors, path) : "";
}

}  // namespace detail

parallel::Groups make_groups(const TrainConfig& cfg, const comm::ProcessGroup& pg) {
  return parallel::make_groups(pg, detail::layout_for(cfg, pg.size()));
}

}  // namespace dtrain::train
