#pragma once
// Gradient clipping by global norm over sharded gradients (ZeRO-1 and ZeRO-2), as
// torch::nn::utils::clip_grad_norm_ over all of the model's gradients in one process.
//
//   loss.backward();
//   double norm = dtrain::optim::clip_grad_norm(opt, /*max_norm=*/1.0);   // every rank calls it
//   opt.step();
//
// Each rank takes the gradients of the parameters it owns (opt.partition(), opt.params()), computes
// its part of the norm (the sum of |g|^p, or the largest |g| for the inf-norm), and one all-reduce
// of a scalar (Sum, or Max) gives every rank the global norm, the norm of all the gradients that
// torch::nn::utils::clip_grad_norm_ would see in one process. When it exceeds max_norm, every rank
// scales its owned gradients by the same max_norm / (norm + 1e-6), as clip_grad_norm_ does.
//
// Under ZeRO-2 (ShardedDataParallel) a rank holds only its owned gradients. Under ZeRO-1 (DDP +
// ShardedOptimizer) every rank holds every (already averaged) gradient but only owners count them,
// so each is counted once; gradients of parameters owned elsewhere are left unscaled on this rank
// (their owner steps them with its own, scaled, copy).
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::optim {

class ShardedOptimizer;

// Collective over the optimizer's process group; returns the global norm (before clipping).
// norm_type: any p > 0, 0 (the number of gradients, as clip_grad_norm_), or infinity.
// error_if_nonfinite: throw (on every rank alike) when the global norm is NaN or infinite.
double clip_grad_norm(const ShardedOptimizer& opt, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

// The same over an explicit process group (the one the optimizer was built over).
double clip_grad_norm(const comm::ProcessGroup& pg, const ShardedOptimizer& opt, double max_norm,
                      double norm_type = 2.0, bool error_if_nonfinite = false);

// Collective over `pg`: `params` are the parameters whose gradients this rank counts and scales;
// across the group every gradient must be counted by exactly one rank. Parameters without a
// gradient are skipped, as in clip_grad_norm_.
double clip_grad_norm(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& params, double max_norm,
                      double norm_type = 2.0, bool error_if_nonfinite = false);

// The same where the gradients a rank counts differ from those it scales: `counted` enter the norm
// (across the group each element counted by exactly one rank), every gradient of `scaled` is
// clipped (e.g. tensor parallelism: a parameter whole on every rank of the group is counted on one
// of them and scaled on all).
double clip_grad_norm(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& counted,
                      const std::vector<at::Tensor>& scaled, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

// The same on gradient tensors themselves (e.g. ranges of a flat shard's gradient, where a range
// is counted on one rank and the whole shard scaled).
double clip_grads(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& counted_grads,
                  const std::vector<at::Tensor>& scaled_grads, double max_norm, double norm_type = 2.0,
                  bool error_if_nonfinite = false);

}  // namespace dtrain::optim
