#pragma once
// train::parallelize(model, plan, groups, hooks): a model put under a plan (parallel/plan.h) in one
// fixed order, each step applied to what the previous one returned (as torchtitan's
// parallelize_llama), giving a Parallel<Model>: its forward runs the model through what the plan
// put around it, its strategy() is what a training step needs (train/strategy.h).
//
//   0. tensor parallelism: the model is already built from tensor_parallel layers on
//      groups.tensor (only the program can build it); the cut is read off it here
//   1. recomputation of the program's layers (hooks.recompute), before any wrapper, so FSDP's
//      hooks nest outside it (HookOrder)
//   2. pipeline parallelism: the model cut into stages (hooks.stages), this rank's run by
//      pipeline::Pipeline over groups.pipeline; its gradients synchronised after each step over
//      the data-parallel group (averaged, or the stages sharded: Design note [sharded stages])
//   3. otherwise the data-parallel wrapper around the model: DDP (ddp, zero1), ZeRO-2's
//      ShardedDataParallel, FSDP (units by hooks.wrap) or DataParallel over local GPUs (dp)
//   4. the optimizer (hooks.optimizer) over what this rank steps: the parameters, ZeRO's owned
//      ones, or the flat shards; and what the rank holds, counted and named for checkpoints
// Which parts steps 2-4 compose is Design note [composed strategies] (train/strategy.h).
#include <functional>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#ifdef DTRAIN_WITH_CUDA  // data_parallel's header needs CUDA's (a CPU-only libtorch has no dp to run)
#include <torch/nn/parallel/data_parallel.h>
#endif

#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/ddp/sharded_data_parallel.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/nn/wrapper.h"
#include "dtrain/util/no_sync_guard.h"
#include "dtrain/parallel/plan.h"
#include "dtrain/pipeline/stage.h"
#include "dtrain/train/config.h"
#include "dtrain/train/plan.h"
#include "dtrain/train/strategy.h"

namespace dtrain::train {

// The model under its plan. Model: a module holder (TORCH_MODULE, torch::nn::Sequential, ...).
template <class Model>
class Parallel {
 public:
  // Runs the model's forward through what the plan put around it; returns what the model returns.
  template <class... Args>
  auto forward(Args&&... args) {
#ifdef DTRAIN_WITH_CUDA
    using Out = decltype(model_->forward(std::forward<Args>(args)...));
    if constexpr (sizeof...(Args) == 1 && std::is_same_v<Out, at::Tensor>) {
      // dp: a Tensor -> Tensor forward over every local GPU (the model must be Cloneable).
      if (local_devices_ > 1) return torch::nn::parallel::data_parallel(model_, std::forward<Args>(args)...);
    }
#endif  // without CUDA local_devices_ stays < 2: dp trains as single
    return nn::run_forward(around_, model_, std::forward<Args>(args)...);
  }
  Strategy& strategy() { return *strategy_; }
  // The unwrapped model (under FSDP its parameters are views that come and go: use the strategy's
  // state_snapshot/export_weights/param_sums for values).
  Model& model() { return model_; }
  void train(bool on = true) {
    if (around_.wrapper) around_.wrapper->train(on);
    model_->train(on);
  }

 private:
  template <class M>
  friend Parallel<M> parallelize(M model, const parallel::Plan& plan, const parallel::Groups& groups, ModelHooks hooks);
  explicit Parallel(Model model) : model_(std::move(model)) {}

  Model model_;
  int64_t local_devices_ = 0;  // dp: the GPUs data_parallel spreads each batch over (>= 2)
  nn::ForwardAround around_;   // the data-parallel wrapper's forward steps (empty: none)
  std::shared_ptr<Strategy> strategy_;
};

// The request's optimizer (--optimizer, --lr) as a factory for ModelHooks::optimizer.
ModelHooks::OptimizerFactory optimizer_factory(const TrainConfig& cfg);

namespace detail {
// What only the program can give, checked before anything is built (std::invalid_argument naming
// the hook and the flag that needs it).
void check_hooks(const parallel::Plan& plan, const parallel::Groups& groups, const ModelHooks& hooks);
// What the plan asks of the model the program built (--sequence-parallel: sequence-parallel layers).
void check_model(const parallel::Plan& plan, const torch::nn::Module& model);
// Step 2: `stages` (the whole model's, in order) on the pipeline group, and steps 3-4 for them.
void build_pipeline(Strategy& s, std::vector<pipeline::Stage> stages, const ModelHooks& hooks);
// Step 4 over the model's own parameters (single, dp, ddp, zero1, zero2).
void hold_tensors(Strategy& s, const ModelHooks& hooks);
// Step 4 over FSDP's flat shards.
void hold_shards(Strategy& s, fsdp::FullyShardedState& state, std::vector<at::Tensor> shards, const ModelHooks& hooks);
fsdp::FullyShardedOptions fsdp_options(const parallel::Plan& plan, const ModelHooks& hooks);
// --grad-compression: DDP's (and ZeRO-1's) bucket hook (null: none), ZeRO-2's wire dtype (unset: none).
std::shared_ptr<ddp::CommHook> comm_hook_of(const parallel::Plan& plan);
c10::optional<at::ScalarType> wire_dtype_of(const parallel::Plan& plan);
// dp: the GPUs of this process data_parallel spreads each batch over (< 2: it trains as single);
// with 2 or more, throws std::invalid_argument unless the model can be replicated (Cloneable, no
// recomputation hooks: the replicas carry none).
int64_t local_devices(const torch::nn::Module& model, const parallel::Plan& plan);

// Whether Model's forward takes one tensor and returns one (what data_parallel scatters and gathers).
template <class Model, class = void>
struct TensorToTensor : std::false_type {};
template <class Model>
struct TensorToTensor<Model, std::enable_if_t<std::is_same_v<
                                 decltype(std::declval<Model&>()->forward(std::declval<at::Tensor>())), at::Tensor>>>
    : std::true_type {};

template <class Wrapper>
std::function<std::shared_ptr<void>()> no_sync_of(const Wrapper& w) {
  return [p = w.ptr()] { return std::make_shared<util::NoSyncGuard>(p->no_sync()); };
}

// Step 3 (and 4): the data-parallel wrapper of plan.data around `model`.
template <class Model>
nn::ForwardAround wrap_data_parallel(Model model, Strategy& s, const ModelHooks& hooks) {
  const parallel::Plan& plan = s.plan();
  const parallel::Groups& g = s.groups();
  switch (plan.data) {
    case parallel::DataParallel::None:
    case parallel::DataParallel::Local:
      hold_tensors(s, hooks);
      return {};
    case parallel::DataParallel::Replicate:
    case parallel::DataParallel::ShardOptimizer: {  // (ZeRO-1: every gradient all-reduced, the state by owner)
      hold_tensors(s, hooks);
      const std::shared_ptr<ddp::CommHook> hook = comm_hook_of(plan);  // (its state checkpointed by the strategy)
      s.set_comm_hook(hook);
      ddp::DistributedDataParallel<Model> w(model, plan.data == parallel::DataParallel::Replicate ? g.replicate : g.shard,
                                            ddp::DistributedDataParallelOptions().bucket_cap_mb(plan.bucket_cap_mb)
                                                .comm_hook(hook)
                                                .hierarchical_all_reduce(plan.hierarchical_all_reduce));
      s.set_no_sync(no_sync_of(w));
      return nn::around_of(w);
    }
    case parallel::DataParallel::ShardGradients: {  // (ZeRO-2: each bucket reduce-scattered to the owners)
      hold_tensors(s, hooks);
      ddp::ShardedDataParallel<Model> w(model, g.shard, s.sharded_optimizer(),
                                        ddp::ShardedDataParallelOptions().bucket_cap_mb(plan.bucket_cap_mb)
                                            .grad_compression(wire_dtype_of(plan)));
      s.set_no_sync(no_sync_of(w));
      return nn::around_of(w);
    }
    case parallel::DataParallel::FullShard: {
      fsdp::FullyShardedDataParallel<Model> w(model, g, fsdp_options(plan, hooks));
      hold_shards(s, w->state(), w->parameters(), hooks);
      s.set_no_sync(no_sync_of(w));
      return nn::around_of(w);
    }
  }
  throw std::logic_error("unknown data-parallel kind");
}
}  // namespace detail

// Puts `model` under `plan` on `groups` (made by make_groups(plan, pg) on every rank, or the
// program's own: hooks.groups). Throws std::invalid_argument for a hook the plan needs and the
// program did not give (--wrap layer without hooks.wrap, --activation-checkpointing without
// hooks.recompute, ...). The plan is validated (make_plan).
template <class Model>
Parallel<Model> parallelize(Model model, const parallel::Plan& plan, const parallel::Groups& groups, ModelHooks hooks) {
  if constexpr (std::is_same_v<Model, torch::nn::Sequential>) {
    if (!hooks.stages) hooks.stages = [model](int n) { return pipeline::split_sequential(model, n); };
  }
  detail::check_hooks(plan, groups, hooks);
  detail::check_model(plan, *model);
  Parallel<Model> p(model);
  p.strategy_ = std::make_shared<Strategy>(model.ptr(), plan, groups);
  Strategy& s = *p.strategy_;
  // 0. tensor parallelism: in the model as the program built it (the holdings read its cut)
  // 1. recomputation, inside every wrapper
  if (plan.recompute) recompute::checkpoint_modules(*model, hooks.recompute);
  // 2. pipeline stages, the data-parallel kind around each and the optimizer (steps 3, 4)
  if (plan.layout.pipeline > 1) {
    detail::build_pipeline(s, hooks.stages(plan.layout.pipeline * plan.pipeline.virtual_stages), hooks);
    return p;
  }
  // 3. the data-parallel wrapper around the model, then 4. the optimizer
  if (plan.data == parallel::DataParallel::Local) {
    p.local_devices_ = detail::local_devices(*model, plan);
    if constexpr (!detail::TensorToTensor<Model>::value) {
      TORCH_CHECK(p.local_devices_ < 2, "--strategy dp needs a forward that takes and returns one tensor");
    }
  }
  p.around_ = detail::wrap_data_parallel(model, s, hooks);
  return p;
}

// The same on pg's ranks: the plan cfg names (make_plan), its groups (or hooks.groups), the
// request's optimizer unless hooks.optimizer is set.
template <class Model>
Parallel<Model> make_parallel(Model model, const TrainConfig& cfg, const comm::ProcessGroup& pg, ModelHooks hooks = {}) {
  const parallel::Plan plan = make_plan(cfg, pg.size());
  if (!hooks.optimizer) hooks.optimizer = optimizer_factory(cfg);
  const parallel::Groups groups = hooks.groups ? *hooks.groups : make_groups(plan, pg);
  return parallelize(std::move(model), plan, groups, std::move(hooks));
}

}  // namespace dtrain::train
