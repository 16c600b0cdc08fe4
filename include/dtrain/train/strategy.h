#pragma once
// The strategy a TrainConfig names, put around a user's model: make_parallel(model, cfg, pg, hooks)
// returns a Parallel<Model> whose forward runs the model through its wrapper (none, DDP, ZeRO-2's
// ShardedDataParallel, FSDP) and whose strategy() is one interface, whatever the strategy, for what
// a training step needs: no_sync, zero_grad, clip_grad_norm, step, the gradients this rank holds
// (what a sharded loss scaler unscales), checkpoint state, weight export, parameter sums.
//
// Composition, in this fixed order (make_parallel; as torchtitan's parallelize_*):
//   0. the parallel layout, one validated value (dtrain/parallel/layout.h; detail::layout_for:
//      single/dp {1, 1}, ddp {W, 1}, zero1/zero2/fsdp {1, W}, hsdp {W/S, S}), and its process groups,
//      made once: every wrapper below takes its groups from it;
//   1. activation checkpointing (cfg.activation_checkpointing): recompute::checkpoint_modules with
//      hooks.recompute, before any wrapper, so FSDP's hooks nest outside it (HookOrder);
//   2. the data-parallel wrapper of cfg.strategy over the layout's groups: single (none), dp (one
//      process over every local GPU: torch::nn::parallel::data_parallel, as PyTorch's DataParallel:
//      inputs scattered along dim 0, the model replicated, outputs gathered on the first GPU,
//      gradients summed back into the model there; with fewer than 2 GPUs it is single), ddp, zero1
//      (DDP + ShardedOptimizer), zero2 (ShardedDataParallel + ShardedOptimizer), fsdp / hsdp (units by
//      hooks.wrap, mixed precision by cfg.precision, offload, init on ranks by hooks.param_init);
//   3. the optimizer over what this rank steps (cfg.optimizer, or hooks.optimizer).
// With --tp (cfg.tp > 1) the model is already cut (the program built it from tensor_parallel layers on
// groups.tensor): step 2 is DDP over groups.replicate or nothing (detail::TensorParallel), or FSDP /
// HSDP over each tensor rank's data-parallel group (detail::TensorParallelSharded).
// With --pp (cfg.pp > 1) step 2 is the pipeline: the layout is pipeline outermost, the model cut by
// hooks.stages into pp x virtual-stages stages, this rank's run by pipeline::Pipeline over the
// pipeline group, their gradients averaged over the data-parallel group once per step: replicated
// (ddp), with the optimizer state sharded (zero1), or parameters, gradients and optimizer state
// sharded (fsdp; detail::Pipelined::Around). With --tp too, each stage is tensor parallel (the program
// cut its TP model into stages) and the pipeline joins the ranks of one tensor rank (ddp or single
// around it).
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#ifdef DTRAIN_WITH_CUDA  // data_parallel's header needs CUDA's (a CPU-only libtorch has no dp to run)
#include <torch/nn/parallel/data_parallel.h>
#endif

#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/compat.h"
#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/ddp/sharded_data_parallel.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/fsdp/wrap.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "dtrain/parallel/layout.h"
#include "dtrain/pipeline/pipeline.h"
#include "dtrain/pipeline/sharded_stages.h"
#include "dtrain/recompute/checkpoint.h"
#include "dtrain/tensor_parallel/plan.h"
#include "dtrain/train/config.h"

namespace dtrain::train {

// What only the program knows about its model.
struct ModelHooks {
  // fsdp/hsdp with --wrap layer: which modules become units (e.g. WrapPolicy::by_type<Block>()).
  // Unset: WrapPolicy::by_size(1) would make every layer that can get hooks a unit; make_parallel
  // asks for it instead (an error naming --wrap none as the way to one unit).
  fsdp::WrapPolicy wrap;
  // --activation-checkpointing: which modules to recompute (e.g. recompute::of_type<Block>()).
  recompute::ModulePicker recompute;
  // --init-on-ranks: writes a parameter's initial values given its name (the model was built
  // without values, e.g. GPTOptions::defer_init).
  std::function<void(const std::string& name, at::Tensor& param)> param_init;
  // --pp: the model cut into n stages (pipeline/stage.h; default for a torch::nn::Sequential: cut
  // at its children, as evenly as possible).
  std::function<std::vector<pipeline::Stage>(int n)> stages;
  // --pp: the loss of the last stage's output (train::fit sets it from its loss function).
  pipeline::LossFn loss;
  // The layout's process groups when the program made them first (train::make_groups), e.g. to
  // build a tensor-parallel model on groups.tensor; make_parallel then uses these.
  std::optional<parallel::Groups> groups;
  // The optimizer for these parameter groups (default: cfg.optimizer with cfg.lr).
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)> optimizer;
};

// The layout cfg names on pg's ranks and its process groups (collective: every rank calls it), for a
// program that needs them before make_parallel (e.g. --tp: the model is built on groups.tensor).
parallel::Groups make_groups(const TrainConfig& cfg, const comm::ProcessGroup& pg);

template <class Model>
class Parallel;
// Puts `model` under cfg.strategy over `pg` (see the order at the top; defined below).
template <class Model>
Parallel<Model> make_parallel(Model model, const TrainConfig& cfg, const comm::ProcessGroup& pg, ModelHooks hooks = {});

class Strategy {
 public:
  virtual ~Strategy() = default;
  // While the returned guard lives, backward communicates nothing (gradient accumulation).
  virtual std::shared_ptr<void> no_sync() = 0;
  virtual void zero_grad() = 0;
  // Clips the gradients to a global norm (over all ranks' shards) and returns that norm.
  virtual double clip_grad_norm(double max_norm) = 0;
  virtual void step() = 0;
  // The parameters whose .grad this rank holds after backward and its optimizer steps: every
  // parameter for single/ddp, the owned ones for zero1/zero2, the flat shards for fsdp/hsdp.
  virtual std::vector<at::Tensor> grads_held() = 0;
  // Bytes of optimizer state held by this rank.
  virtual int64_t optimizer_state_bytes() = 0;
  // This rank's part of the model and optimizer state under the plain model's names
  // (dtrain/checkpoint/train_state.h: a checkpoint resumes under another strategy or world size),
  // and loading it back. No communication.
  virtual checkpoint::Snapshot state_snapshot() = 0;
  virtual void load_state(const checkpoint::Reader& reader) = 0;
  // The trained weights as one plain safetensors file at `path` (each parameter once under its name
  // in the unwrapped model, then the buffers), written by rank 0. Returns the path on rank 0, ""
  // elsewhere. Collective for strategies that shard parameters.
  virtual std::string export_weights(const std::string& path);
  // Sum and sum of squares of every parameter, in double (identical on every rank). Collective for
  // strategies that shard parameters.
  virtual std::pair<double, double> param_sums();
  // Peak bytes of parameters and gradients this rank owned (sharded strategies; -1: not tracked).
  virtual int64_t peak_owned_bytes() { return -1; }
  // The optimizer this rank steps (ShardedOptimizer::local() for zero1/zero2).
  virtual torch::optim::Optimizer& optimizer() = 0;
  // --pp: the pipeline that runs each step's forwards and backwards (nullptr otherwise).
  virtual pipeline::Pipeline* pipeline() { return nullptr; }
  // After the step's last backward, before unscaling and clipping: work the backward hooks did not
  // do (--pp: the data-parallel average of the stages' gradients).
  virtual void after_backward() {}
  const comm::ProcessGroup& process_group() const { return pg_; }
  // The layout the ranks train in (make_parallel's step 0).
  const parallel::Layout& layout() const { return layout_; }
  // --tp: the tensor-parallel group (whose ranks must draw the same default random stream, Design
  // note [dropout streams]); nullptr otherwise.
  virtual const comm::ProcessGroup* tensor_group() const { return nullptr; }

 protected:
  Strategy(std::shared_ptr<torch::nn::Module> model, comm::ProcessGroup pg) : model_(std::move(model)), pg_(std::move(pg)) {}
  std::shared_ptr<torch::nn::Module> model_;  // the unwrapped model
  comm::ProcessGroup pg_;

 private:
  template <class M>
  friend Parallel<M> make_parallel(M model, const TrainConfig& cfg, const comm::ProcessGroup& pg, ModelHooks hooks);
  parallel::Layout layout_;
};

namespace detail {
// Whether Model's forward takes one tensor and returns one (what data_parallel scatters and gathers).
template <class Model, class = void>
struct TensorToTensor : std::false_type {};
template <class Model>
struct TensorToTensor<Model, std::enable_if_t<std::is_same_v<
                                 decltype(std::declval<Model&>()->forward(std::declval<at::Tensor>())), at::Tensor>>>
    : std::true_type {};

// Sum and sum of squares of `tensors`, in double, summed over `group` (each element must be held by
// one rank of it): the whole model's param_sums for strategies that split it.
std::pair<double, double> sums_over(const comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors);
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& cfg, const ModelHooks& hooks,
                                                        std::vector<torch::optim::OptimizerParamGroup> groups);
// make_parallel's step 0: the layout of cfg.strategy on `world` ranks (validated; throws
// std::invalid_argument naming the flags when it does not fit).
parallel::Layout layout_for(const TrainConfig& cfg, int world);
fsdp::FullyShardedOptions fsdp_options(const TrainConfig& cfg, const ModelHooks& hooks);
void check_strategy(const TrainConfig& cfg, const comm::ProcessGroup& pg, const ModelHooks& hooks);
// dp: how many local GPUs data_parallel uses (0 or 1: it trains as single; rank 0 says so).
int64_t data_parallel_devices(const TrainConfig& cfg);
// dp on several GPUs replicates the model by clone() at every forward (hooks are not copied):
// throws std::invalid_argument unless the model is Cloneable and no recomputation is asked for.
void check_replicable(const torch::nn::Module& model, const TrainConfig& cfg);

// single and ddp: a plain optimizer over full gradients (identical on every rank under DDP).
class Replicated : public Strategy {
 public:
  Replicated(std::shared_ptr<torch::nn::Module> model, const comm::ProcessGroup& pg, const TrainConfig& cfg,
             const ModelHooks& hooks);
  std::shared_ptr<void> no_sync() override { return no_sync_ ? no_sync_() : nullptr; }
  void zero_grad() override { compat::zero_grad_in_place(*optimizer_); }
  double clip_grad_norm(double max_norm) override;
  void step() override { optimizer_->step(); }
  std::vector<at::Tensor> grads_held() override { return model_->parameters(); }
  int64_t optimizer_state_bytes() override;
  checkpoint::Snapshot state_snapshot() override;
  void load_state(const checkpoint::Reader& reader) override;
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }
  std::function<std::shared_ptr<void>()> no_sync_;  // set by Parallel for ddp

 protected:
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// zero1: DDP (full gradients everywhere) + optimizer state sharded by parameter.
// zero2: gradients reduce-scattered to their owners (ShardedDataParallel) + the same sharded optimizer.
class Sharded : public Strategy {
 public:
  Sharded(std::shared_ptr<torch::nn::Module> model, const comm::ProcessGroup& pg, const TrainConfig& cfg,
          const ModelHooks& hooks);
  std::shared_ptr<void> no_sync() override { return no_sync_(); }
  void zero_grad() override { optimizer_.zero_grad(); }
  double clip_grad_norm(double max_norm) override;
  void step() override { optimizer_.step(); }
  std::vector<at::Tensor> grads_held() override;
  int64_t optimizer_state_bytes() override;
  checkpoint::Snapshot state_snapshot() override;
  void load_state(const checkpoint::Reader& reader) override;
  torch::optim::Optimizer& optimizer() override { return optimizer_.local(); }
  optim::ShardedOptimizer& sharded_optimizer() { return optimizer_; }
  std::function<std::shared_ptr<void>()> no_sync_;  // set by Parallel

 private:
  optim::ShardedOptimizer optimizer_;
};

// fsdp / hsdp: the optimizer steps this rank's flat fp32 shards.
class FullySharded : public Strategy {
 public:
  FullySharded(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state,
               std::vector<at::Tensor> shards, const comm::ProcessGroup& pg, const TrainConfig& cfg,
               const ModelHooks& hooks);
  std::shared_ptr<void> no_sync() override;
  void zero_grad() override { compat::zero_grad_in_place(*optimizer_); }
  double clip_grad_norm(double max_norm) override { return state_.clip_grad_norm(max_norm, 2.0); }
  void step() override { optimizer_->step(); }
  std::vector<at::Tensor> grads_held() override { return shards_; }
  int64_t optimizer_state_bytes() override;
  int64_t peak_owned_bytes() override { return state_.peak_owned_bytes(); }
  std::pair<double, double> param_sums() override;
  checkpoint::Snapshot state_snapshot() override;
  void load_state(const checkpoint::Reader& reader) override;
  std::string export_weights(const std::string& path) override { return state_.export_full_weights(path, 0); }
  torch::optim::Optimizer& optimizer() override { return *optimizer_; }

 protected:
  fsdp::FullyShardedState& state_;
  std::vector<at::Tensor> shards_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// --pp: the model cut into stages on the pipeline group, and around each stage, over its
// data-parallel group, one of Around's ways. Checkpoints name every tensor as the whole model does
// (each stage's data-parallel ranks write their part of it), so they load without the pipeline, with
// another stage count or with another way around the stages.
class Pipelined : public Strategy {
 public:
  // How the data-parallel ranks of a stage share it (cfg.strategy).
  enum class Around {
    Replicated,  // single / ddp: every rank holds its stages whole; gradients all-reduced once per step
    ZeRO1,       // zero1: as Replicated, with the optimizer state sharded by parameter (each owner
                 // steps its parameters and broadcasts them)
    FullyShard,  // fsdp: parameters, gradients and optimizer state sharded, each stage one unit
                 // gathered for the whole step (Design note [sharded stages], pipeline/sharded_stages.h)
  };
  Pipelined(std::shared_ptr<torch::nn::Module> model, std::vector<pipeline::Stage> stages, const parallel::Groups& groups,
            const TrainConfig& cfg, const ModelHooks& hooks);
  std::shared_ptr<void> no_sync() override { return nullptr; }  // (nothing is reduced in backward)
  void zero_grad() override;
  // The global 2-norm over every stage (each gradient element once), then clipped as clip_grad_norm_.
  double clip_grad_norm(double max_norm) override;
  void step() override;
  std::vector<at::Tensor> grads_held() override;
  int64_t optimizer_state_bytes() override;
  checkpoint::Snapshot state_snapshot() override;
  void load_state(const checkpoint::Reader& reader) override;
  // Collective (world): the whole model's values gathered on every rank first.
  std::string export_weights(const std::string& path) override;
  std::pair<double, double> param_sums() override;
  torch::optim::Optimizer& optimizer() override;
  pipeline::Pipeline* pipeline() override { return pipeline_.get(); }
  // The stages' gradients averaged over the data-parallel group (reduce-scattered for fsdp).
  void after_backward() override;
  Around around() const { return around_; }
  const comm::ProcessGroup* tensor_group() const override { return plan_ ? &groups_.tensor : nullptr; }

 private:
  // Every stage's current values into model_ on every rank; returns whether it gathered the
  // sharded stages (then the caller reshards them when done reading, and releases the others).
  bool gather_whole_model();
  // Design note [a rank keeps its stages]
  // A rank holds the parameters of its own stages only: the others' (built with the whole model,
  // as a libtorch module cannot be built without values) are released once the pipeline is made
  // and come back, as zeros then filled, only for whole-model work: loading a checkpoint (every key
  // checked against the whole model), the final sums and the weights export.
  void materialize_others();
  void release_others();
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> others_;  // the other stages' parameters, full shapes
  Around around_;
  parallel::Groups groups_;  // (before sharded_: its FlatParams point at it)
  std::unique_ptr<pipeline::Pipeline> pipeline_;
  std::unique_ptr<pipeline::ShardedStages> sharded_;      // FullyShard
  std::unique_ptr<optim::ShardedOptimizer> zero_;         // ZeRO1
  std::unique_ptr<torch::optim::Optimizer> optimizer_;    // Replicated, FullyShard (over the shards)
  // --tp with --pp (Replicated only): how the model's parameters are cut over groups_.tensor.
  std::optional<tensor_parallel::Plan> plan_;
  std::vector<at::Tensor> counted_;  // with plan_: the stage parameters this rank counts in norms and sums
};
// --tp: a model built from tensor-parallel layers (dtrain/tensor_parallel/), each rank holding its
// pieces (tensor_parallel::Plan reads how each parameter is cut off the model's modules);
// replicated over the data-parallel group (ddp: DDP over groups.replicate, the ranks of one tensor
// rank) or not (single). Clipping counts each element once (cut parameters over the tensor group,
// whole ones once); checkpoints and exports hold the plain model's names and full shapes, so they
// load at another --tp or without it.
class TensorParallel : public Replicated {
 public:
  TensorParallel(std::shared_ptr<torch::nn::Module> model, const parallel::Groups& groups, const TrainConfig& cfg,
                 const ModelHooks& hooks);
  double clip_grad_norm(double max_norm) override;
  // Collective over the tensor group (each piece gathered to its full tensor); each world rank
  // writes 1/W of every full tensor.
  checkpoint::Snapshot state_snapshot() override;
  void load_state(const checkpoint::Reader& reader) override;
  std::string export_weights(const std::string& path) override;
  std::pair<double, double> param_sums() override;
  const comm::ProcessGroup* tensor_group() const override { return &groups_.tensor; }

 private:
  parallel::Groups groups_;
  tensor_parallel::Plan plan_;
  // The parameters this rank counts in norms and sums (Plan::counts).
  std::vector<at::Tensor> counted_;
};

// --tp with fsdp / hsdp: FSDP over each tensor rank's data-parallel group, sharding that rank's
// pieces (Design note [TP inside FSDP], tensor_parallel/sharded.h). Norms and sums count every
// element once over the world; checkpoints hold the plain model's names and full shapes, each
// rank writing the ranges of the full tensors its shards hold (no gather).
class TensorParallelSharded : public FullySharded {
 public:
  TensorParallelSharded(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state,
                        std::vector<at::Tensor> shards, const parallel::Groups& groups, const TrainConfig& cfg,
                        const ModelHooks& hooks);
  double clip_grad_norm(double max_norm) override;
  std::pair<double, double> param_sums() override;
  checkpoint::Snapshot state_snapshot() override;
  void load_state(const checkpoint::Reader& reader) override;
  // Collective: each unit gathered over the data-parallel group, each piece over the tensor group.
  std::string export_weights(const std::string& path) override;
  const comm::ProcessGroup* tensor_group() const override { return &groups_.tensor; }

 private:
  // The shards' ranges in full-tensor coordinates (writing: each element on one rank).
  fsdp::ShardView view(bool writing) const;
  // (shard index, (offset, count)) of the ranges this rank counts in norms and sums.
  std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> ranges_counted() const;
  parallel::Groups groups_;
  tensor_parallel::Plan plan_;
  std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> counted_ranges_;  // ranges_counted(), once
};
}  // namespace detail

// The model under its strategy. Model: a module holder (TORCH_MODULE, torch::nn::Sequential, ...).
template <class Model>
class Parallel {
 public:
  // Runs the model's forward through the strategy's wrapper; returns what the model returns.
  template <class... Args>
  auto forward(Args&&... args) {
#ifdef DTRAIN_WITH_CUDA
    using Out = decltype(model_->forward(std::forward<Args>(args)...));
    if constexpr (sizeof...(Args) == 1 && std::is_same_v<Out, at::Tensor>) {
      // dp: a Tensor -> Tensor forward over every local GPU (the model must be Cloneable).
      if (dp_devices_ > 1) return torch::nn::parallel::data_parallel(model_, std::forward<Args>(args)...);
    }
#endif  // without CUDA dp_devices_ stays < 2: dp trains as single
    if (fsdp_) return (*fsdp_)->forward(std::forward<Args>(args)...);
    if (ddp_) return (*ddp_)->forward(std::forward<Args>(args)...);
    if (sdp_) return (*sdp_)->forward(std::forward<Args>(args)...);
    return model_->forward(std::forward<Args>(args)...);
  }
  Strategy& strategy() { return *strategy_; }
  // The unwrapped model (under FSDP its parameters are views that come and go: use the strategy's
  // state_snapshot/export_weights/param_sums for values).
  Model& model() { return model_; }
  void train(bool on = true) {
    if (fsdp_) (*fsdp_)->train(on);
    if (ddp_) (*ddp_)->train(on);
    if (sdp_) (*sdp_)->train(on);
    model_->train(on);
  }

 private:
  template <class M>
  friend Parallel<M> make_parallel(M model, const TrainConfig& cfg, const comm::ProcessGroup& pg, ModelHooks hooks);
  explicit Parallel(Model model) : model_(std::move(model)) {}

  Model model_;
  int64_t dp_devices_ = 0;  // dp: the GPUs data_parallel spreads each batch over (>= 2)
  std::shared_ptr<fsdp::FullyShardedDataParallel<Model>> fsdp_;
  std::shared_ptr<ddp::DistributedDataParallel<Model>> ddp_;
  std::shared_ptr<ddp::ShardedDataParallel<Model>> sdp_;
  std::shared_ptr<Strategy> strategy_;
};

// Puts `model` under cfg.strategy over `pg` (see the order at the top). Throws std::invalid_argument
// for a combination that cannot work (e.g. --strategy single with several ranks, --wrap layer
// without hooks.wrap, --activation-checkpointing without hooks.recompute).
template <class Model>
Parallel<Model> make_parallel(Model model, const TrainConfig& cfg, const comm::ProcessGroup& pg, ModelHooks hooks) {
  if constexpr (std::is_same_v<Model, torch::nn::Sequential>) {
    if (cfg.pp > 1 && !hooks.stages) hooks.stages = [model](int n) { return pipeline::split_sequential(model, n); };
  }
  detail::check_strategy(cfg, pg, hooks);
  Parallel<Model> p(model);
  // 0. the layout and its groups (made once: the program's, when it made them first)
  const parallel::Groups groups = hooks.groups ? *hooks.groups : make_groups(cfg, pg);
  // 1. activation checkpointing
  if (cfg.activation_checkpointing) recompute::checkpoint_modules(*model, hooks.recompute);
  // 2. the data-parallel wrapper, 3. the optimizer
  const std::shared_ptr<torch::nn::Module> plain = model.ptr();
  if (cfg.pp > 1) {  // 2'. the pipeline (its stages on this rank) with ddp, zero1, fsdp or nothing around them
    p.strategy_ = std::make_shared<detail::Pipelined>(
        plain, hooks.stages(cfg.pp * cfg.virtual_stages), groups, cfg, hooks);
    p.strategy_->layout_ = groups.layout;
    return p;
  }
  const auto ddp_options = ddp::DistributedDataParallelOptions().bucket_cap_mb(cfg.bucket_cap_mb);
  if (cfg.tp > 1 && cfg.fsdp()) {  // 2''. tensor parallel inside the model, fsdp / hsdp around it
    p.fsdp_ = std::make_shared<fsdp::FullyShardedDataParallel<Model>>(model, groups, detail::fsdp_options(cfg, hooks));
    p.strategy_ = std::make_shared<detail::TensorParallelSharded>(plain, (*p.fsdp_)->state(), (*p.fsdp_)->parameters(),
                                                                  groups, cfg, hooks);
    p.strategy_->layout_ = groups.layout;
    return p;
  }
  if (cfg.tp > 1) {  // 2''. tensor parallel inside the model, ddp or nothing around it
    auto s = std::make_shared<detail::TensorParallel>(plain, groups, cfg, hooks);
    if (cfg.strategy == "ddp") {
      p.ddp_ = std::make_shared<ddp::DistributedDataParallel<Model>>(model, groups.replicate, ddp_options);
      auto wrapper = p.ddp_;
      s->no_sync_ = [wrapper] { return std::make_shared<ddp::DataParallelState::NoSyncGuard>((*wrapper)->no_sync()); };
    }
    p.strategy_ = s;
    p.strategy_->layout_ = groups.layout;
    return p;
  }
  if (cfg.strategy == "single" || cfg.strategy == "ddp" || cfg.strategy == "dp") {
    auto s = std::make_shared<detail::Replicated>(plain, groups.replicate, cfg, hooks);
    if (cfg.strategy == "dp") {
      p.dp_devices_ = detail::data_parallel_devices(cfg);
      if (p.dp_devices_ > 1) detail::check_replicable(*plain, cfg);
      if constexpr (!detail::TensorToTensor<Model>::value) {
        TORCH_CHECK(p.dp_devices_ < 2, "--strategy dp needs a forward that takes and returns one tensor");
      }
    }
    if (cfg.strategy == "ddp") {
      p.ddp_ = std::make_shared<ddp::DistributedDataParallel<Model>>(model, groups.replicate, ddp_options);
      auto wrapper = p.ddp_;
      s->no_sync_ = [wrapper] { return std::make_shared<ddp::DataParallelState::NoSyncGuard>((*wrapper)->no_sync()); };
    }
    p.strategy_ = s;
  } else if (cfg.strategy == "zero1" || cfg.strategy == "zero2") {
    // (layout {1, W}: the shard group is the world, over which ZeRO-1's DDP all-reduces too)
    auto s = std::make_shared<detail::Sharded>(plain, groups.shard, cfg, hooks);
    if (cfg.strategy == "zero1") {
      p.ddp_ = std::make_shared<ddp::DistributedDataParallel<Model>>(model, groups.shard, ddp_options);
      auto wrapper = p.ddp_;
      s->no_sync_ = [wrapper] { return std::make_shared<ddp::DataParallelState::NoSyncGuard>((*wrapper)->no_sync()); };
    } else {
      p.sdp_ = std::make_shared<ddp::ShardedDataParallel<Model>>(
          model, groups.shard, s->sharded_optimizer(), ddp::ShardedDataParallelOptions().bucket_cap_mb(cfg.bucket_cap_mb));
      auto wrapper = p.sdp_;
      s->no_sync_ = [wrapper] {
        using Guard = decltype((*wrapper)->no_sync());
        return std::make_shared<Guard>((*wrapper)->no_sync());
      };
    }
    p.strategy_ = s;
  } else {
    p.fsdp_ = std::make_shared<fsdp::FullyShardedDataParallel<Model>>(model, groups, detail::fsdp_options(cfg, hooks));
    p.strategy_ = std::make_shared<detail::FullySharded>(plain, (*p.fsdp_)->state(), (*p.fsdp_)->parameters(), pg, cfg, hooks);
  }
  p.strategy_->layout_ = groups.layout;
  return p;
}

}  // namespace dtrain::train
