#pragma once
// What a rank holds of the model's parameters, and how that state is counted, named in checkpoints
// and exported (Design note [composed strategies], train/strategy.h). Two kinds, one file each:
//   TensorHolding  the parameters as tensors: the model's, or this rank's pipeline stages'; whole,
//                  or tensor-parallel pieces; stepped by a replicated or a ZeRO optimizer
//                  (tensor_holding.cpp)
//   ShardHolding   flat shards: FSDP's, or the pipeline stages' (pipeline::ShardedStages); whole
//                  or pieces; stepped by a plain optimizer over the shards (shard_holding.cpp)
// Every name is the plain model's and every tensor has its full shape in a checkpoint
// (checkpoint/train_state.h), so a checkpoint moves between any two plans.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/parallel/layout.h"
#include "dtrain/tensor_parallel/plan.h"
#include "optimizer_part.h"
#include "whole_model.h"

namespace dtrain::fsdp {
class FullyShardedState;
}
namespace dtrain::pipeline {
class ShardedStages;
}

namespace dtrain::train::detail {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
// Tensor parallelism: how the model's parameters are cut over the tensor group (none: whole).
using Cut = std::optional<tensor_parallel::Plan>;

class Holding {
 public:
  virtual ~Holding() = default;
  virtual void before_zero_grad() {}
  virtual void after_step() {}
  // The parameters whose .grad this rank holds after backward and its optimizer steps.
  virtual std::vector<at::Tensor> grads_held(OptimizerPart& opt) = 0;
  // Clips every gradient to the global 2-norm (each element counted once over the world).
  virtual double clip_grad_norm(OptimizerPart& opt, double max_norm) = 0;
  // Sum and sum of squares of every parameter element, once over the world (collective).
  virtual std::pair<double, double> param_sums(OptimizerPart& opt) = 0;
  // `held`: every element this rank holds (replicas too), not its share of the writing.
  virtual checkpoint::Snapshot snapshot(OptimizerPart& opt, bool held) = 0;
  virtual void load(const checkpoint::Reader& reader, OptimizerPart& opt) = 0;
  // The whole model's weights as one safetensors file, written by world rank 0 (collective).
  virtual std::string export_weights(const std::string& path) = 0;
  virtual int64_t peak_owned_bytes() { return -1; }
  // Before the model is put under a plan again (Strategy::release_model): FSDP gives the module
  // its parameters back; the others hold the module's own.
  virtual void release_model() {}
};

// `model`: the whole model. `params`: what this rank holds under the model's names (every name,
// tied ones too; the pipeline's stages' only with `whole`), `buffers` likewise; the optimizer steps
// unique_tensors(params) in that order.
std::unique_ptr<Holding> tensor_holding(std::shared_ptr<torch::nn::Module> model, NamedTensors params,
                                        NamedTensors buffers, const parallel::Groups& groups, Cut cut,
                                        std::unique_ptr<WholeModel> whole);
// FSDP's flat shards (`state` of its wrapper over the whole model).
std::unique_ptr<Holding> fsdp_holding(std::shared_ptr<torch::nn::Module> model, fsdp::FullyShardedState& state,
                                      const parallel::Groups& groups, Cut cut);
// The pipeline stages' flat shards (ShardedStages), with this rank's stage buffers.
std::unique_ptr<Holding> stages_holding(pipeline::ShardedStages& stages, NamedTensors buffers,
                                        const parallel::Groups& groups, Cut cut, std::unique_ptr<WholeModel> whole);

// Each tensor of `named` once (a tied alias dropped), in order.
NamedTensors unique_tensors(const NamedTensors& named);
NamedTensors named_parameters(const torch::nn::Module& m);
NamedTensors named_buffers(const torch::nn::Module& m);
// Sum and sum of squares of `tensors` in double, summed over `group` (collective).
std::pair<double, double> sums_over(const comm::ProcessGroup& group, const std::vector<at::Tensor>& tensors);
// Loading pieces of full tensors (tensor parallelism), or whole tensors without a cut.
checkpoint::Pieces pieces_of(const Cut& cut);
// `t` in full (collective over the cut's tensor group) when `name` is cut; `t` otherwise.
at::Tensor full_of(const Cut& cut, const std::string& name, const at::Tensor& t);

}  // namespace dtrain::train::detail
