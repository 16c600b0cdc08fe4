#pragma once
// What a training step needs from the way a model is trained, whatever the plan: Strategy, one
// class composed by train::parallelize (train/parallelize.h) from small parts, and ModelHooks,
// what only the program knows about its model.
//
// Design note [composed strategies]
// ---------------------------------
// A plan (parallel/plan.h) is degrees and kinds, not a name, so no class stands for a combination.
// A Strategy is three parts, each chosen by one property of the plan:
//   how gradients are synchronised   in backward by the data-parallel wrapper (DDP, ZeRO-2's
//                                    ShardedDataParallel, FSDP: no_sync() is the wrapper's), or
//                                    once after a pipeline step (after_backward(): averaged over
//                                    the data-parallel group, or the sharded stages reduced)
//   how the optimizer state is split replicated, or ZeRO's by owner (src/train/state/optimizer_part.h)
//   what a rank holds, and how that  tensors of the model or of its pipeline stages, whole or
//   state is counted and named       tensor-parallel pieces; or flat shards, FSDP's or the stages'
//                                    (src/train/state/holding.h)
// Every holding counts each element once over the world in norms and sums, and names every tensor
// as the plain model does in checkpoints (full shapes, checkpoint/train_state.h), so a checkpoint
// moves between any two plans. Adding a capability adds a part, not a class per combination.
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/fsdp/wrap.h"
#include "dtrain/parallel/layout.h"
#include "dtrain/parallel/plan.h"
#include "dtrain/pipeline/pipeline.h"
#include "dtrain/pipeline/stage.h"
#include "dtrain/recompute/checkpoint.h"

namespace dtrain::pipeline {
class ShardedStages;
}
namespace dtrain::optim {
class ShardedOptimizer;
}
namespace dtrain::ddp {
class CommHook;
}

namespace dtrain::train {

namespace detail {
class OptimizerPart;
class Holding;
}  // namespace detail

// What only the program knows about its model.
struct ModelHooks {
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;
  // fsdp/hsdp with --wrap layer: which modules become units (e.g. WrapPolicy::by_type<Block>()).
  // Unset: an error naming --wrap none as the way to one unit.
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
  // The plan's process groups when the program made them first (train::make_groups), e.g. to build
  // a tensor-parallel model on groups.tensor; parallelize then uses these.
  std::optional<parallel::Groups> groups;
  // The optimizer for these parameter groups (default: the request's optimizer and learning rate).
  OptimizerFactory optimizer;
};

class Strategy {
 public:
  Strategy(std::shared_ptr<torch::nn::Module> model, parallel::Plan plan, parallel::Groups groups);
  ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // While the returned guard lives, backward communicates nothing (gradient accumulation).
  std::shared_ptr<void> no_sync() { return no_sync_ ? no_sync_() : nullptr; }
  void zero_grad();
  // Clips the gradients to a global 2-norm (each element counted once over the world); returns it.
  double clip_grad_norm(double max_norm);
  void step();
  // The parameters whose .grad this rank holds after backward and its optimizer steps (what a
  // sharded loss scaler unscales): every parameter, ZeRO's owned ones, or the flat shards.
  std::vector<at::Tensor> grads_held();
  // Bytes of optimizer state held by this rank.
  int64_t optimizer_state_bytes();
  // This rank's part of the model and optimizer state under the plain model's names
  // (checkpoint/train_state.h: a checkpoint resumes under any other plan or world size), and
  // loading it back. Collective over the tensor group with tensor parallelism. The pieces are views
  // of the live state: write or copy them before the next step (Design note [snapshots are views],
  // dtrain/checkpoint/piece.h). `scope`: each element once over the world (a checkpoint's), or
  // every element this rank holds, replicas included (the live copies in-process recovery re-splits
  // where the state is held in whole units: Design note [whole units], train/elastic.h).
  enum class Scope { Written, Held };
  checkpoint::Snapshot state_snapshot(Scope scope = Scope::Written);
  // The tensors that only step() changes: the parameters this rank's optimizer holds and their
  // state (what an asynchronous save copies during the next step's forwards and backwards: Design
  // note [a copy overlapped with the next step], dtrain/checkpoint/async_saver.h).
  std::vector<at::Tensor> steady_tensors();
  // Returns whether the gradient-compression hook's state came back with it (at the same world
  // size with every rank's part there, decided alike on every rank; false: none saved, none used,
  // or starting over).
  bool load_state(const checkpoint::Reader& reader);
  // --elastic, after a membership change (Design note [gradient compression], ddp/comm_hook.h): a
  // hook whose state did not come back with the re-split starts over on every rank alike, its
  // warm-up counted from `step` (the run's, so a regroup does not warm up again). Nothing without
  // a hook. Rank 0 says it for a hook with state (PowerSGD).
  void continue_compression_at(int64_t step);
  // The trained weights as one plain safetensors file at `path` (each parameter once under its name
  // in the unwrapped model, then the buffers), written by rank 0. Returns the path on rank 0, ""
  // elsewhere. Collective.
  std::string export_weights(const std::string& path);
  // Sum and sum of squares of every parameter, in double (identical on every rank). Collective.
  std::pair<double, double> param_sums();
  // Peak bytes of parameters and gradients this rank owned (FSDP; -1: not tracked).
  int64_t peak_owned_bytes();
  // Before the model is put under a plan again (in-process recovery: Design note [sharded state in
  // process], train/recovery.h): FSDP gives the module its parameters back (zeros, full shapes)
  // and removes its hooks; the state held (state_snapshot) stays readable. Local.
  void release_model();
  // The optimizer this rank steps (ZeRO: its local optimizer over the owned parameters).
  torch::optim::Optimizer& optimizer();
  // --pp: the pipeline that runs each step's forwards and backwards (nullptr otherwise).
  pipeline::Pipeline* pipeline() { return pipeline_.get(); }
  // After the step's last backward, before unscaling and clipping: what backward hooks did not do
  // (--pp: the data-parallel average of the stages' gradients).
  void after_backward() {
    if (after_backward_) after_backward_();
  }
  const parallel::Plan& plan() const { return plan_; }
  const parallel::Layout& layout() const { return plan_.layout; }
  const parallel::Groups& groups() const { return groups_; }
  // --tp: the tensor-parallel group (whose ranks must draw the same default random stream, Design
  // note [dropout streams]); nullptr otherwise.
  const comm::ProcessGroup* tensor_group() const { return plan_.layout.tensor > 1 ? &groups_.tensor : nullptr; }

  // Composition (train::parallelize; the parts' headers are src/train/state/).
  std::shared_ptr<torch::nn::Module> model() const { return model_; }
  void set_pipeline(std::unique_ptr<pipeline::Pipeline> p);
  void set_sharded_stages(std::unique_ptr<pipeline::ShardedStages> s);
  pipeline::ShardedStages* sharded_stages() { return stages_.get(); }
  void set_parts(std::unique_ptr<detail::OptimizerPart> optimizer, std::unique_ptr<detail::Holding> holding);
  void set_no_sync(std::function<std::shared_ptr<void>()> f) { no_sync_ = std::move(f); }
  void set_after_backward(std::function<void()> f) { after_backward_ = std::move(f); }
  // --grad-compression with a hook that keeps state (PowerSGD): checkpointed with the rest.
  void set_comm_hook(std::shared_ptr<ddp::CommHook> hook) { comm_hook_ = std::move(hook); }
  detail::OptimizerPart& optimizer_part() { return *optimizer_; }
  // ZeRO's optimizer (zero1, zero2: what ShardedDataParallel reduces to); throws otherwise.
  optim::ShardedOptimizer& sharded_optimizer();

 private:
  std::shared_ptr<torch::nn::Module> model_;  // the unwrapped model
  parallel::Plan plan_;
  parallel::Groups groups_;  // (before the parts: they keep references to it)
  std::unique_ptr<pipeline::Pipeline> pipeline_;
  std::unique_ptr<pipeline::ShardedStages> stages_;
  std::unique_ptr<detail::OptimizerPart> optimizer_;
  std::unique_ptr<detail::Holding> holding_;
  std::function<std::shared_ptr<void>()> no_sync_;
  std::function<void()> after_backward_;
  std::shared_ptr<ddp::CommHook> comm_hook_;  // (the data-parallel wrapper's; null: none)
};

}  // namespace dtrain::train
