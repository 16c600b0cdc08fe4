#pragma once
// How the optimizer state of a rank's parameters is split over its data-parallel group, one of
// two ways (Design note [composed strategies], train/strategy.h):
//   replicated  a plain optimizer over every parameter; the replicas step alike (single, dp, ddp,
//               and FSDP over its flat shards, which are this rank's own)
//   sharded     ZeRO's ShardedOptimizer: each parameter's state on its owner, who steps it and
//               broadcasts it (zero1, zero2)
// Holdings (holding.h) read it to name, count and load the state; it runs no collective of its
// own but the ZeRO step's broadcasts.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "dtrain/optim/state_dict.h"

namespace dtrain::train::detail {

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

class OptimizerPart {
 public:
  // A plain optimizer over `params`; `replica` is this rank's data-parallel rank when the replicas
  // hold equal gradients (only replica 0 counts them in norms), 0 when each rank's are its own.
  static std::unique_ptr<OptimizerPart> replicated(std::vector<at::Tensor> params, const OptimizerFactory& make,
                                                   int replica);
  // ZeRO over `group`: each parameter stepped by its owner.
  static std::unique_ptr<OptimizerPart> sharded(std::vector<at::Tensor> params, const comm::ProcessGroup& group,
                                                const OptimizerFactory& make);

  torch::optim::Optimizer& optimizer() { return sharded_ ? sharded_->local() : *plain_; }
  optim::ShardedOptimizer* zero() { return sharded_.get(); }
  bool is_sharded() const { return sharded_ != nullptr; }
  // Every gradient zeroed in place (ZeRO: not only the owned ones: every one is reduced).
  void zero_grad();
  void step();
  const std::vector<at::Tensor>& params() const { return params_; }
  // Indices into params() of what this rank steps (ZeRO: the owned ones; else all).
  const std::vector<size_t>& stepped() const { return stepped_; }
  std::vector<at::Tensor> stepped_params() const;
  // Whether this rank counts params()[i]'s gradient in a norm over the world (each replica's
  // element once): the owner (ZeRO), or replica 0.
  bool counts(size_t i) const { return counted_[i]; }
  // The state of stepped() as optim::state_dict_view gives it for stepped_params() (the live
  // tensors: Design note [snapshots are views], dtrain/checkpoint/piece.h).
  optim::OptimizerStateDict state_dict();
  int64_t state_bytes();

 private:
  OptimizerPart() = default;
  std::vector<at::Tensor> params_;
  std::vector<size_t> stepped_;
  std::vector<bool> counted_;
  std::unique_ptr<torch::optim::Optimizer> plain_;
  std::unique_ptr<optim::ShardedOptimizer> sharded_;
};

}  // namespace dtrain::train::detail
