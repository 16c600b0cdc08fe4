#pragma once
// PowerSGD gradient compression (Vogels et al. 2019), as PyTorch's powerSGD_hook: Design note
// [gradient compression] (ddp/comm_hook.h).
//
// For each gradient of a bucket that is a matrix M (n x m: the first dimension by the rest) and
// that rank R makes at least min_compression_rate times smaller ((n + m) R * rate < n m):
//   M += e                       (error feedback: what compression left out last step)
//   P = M Q;   P = sum over ranks;   P = orthogonalize(P)   (Gram-Schmidt, column by column)
//   Q = M^T P; Q = mean over ranks
//   M ~ P Q^T                    (the mean's rank-R approximation, the same on every rank)
//   e = (M + e) - P Q^T          (this rank's own error)
// The other gradients (vectors, small matrices) are averaged uncompressed in the same all-reduce
// as P. Q starts random (the same seed on every rank, a generator of its own) and is kept from step
// to step (warm start). The first `warmup_steps` steps average everything uncompressed (PyTorch's
// start_powerSGD_iter). A rank sends (n + m) R elements per matrix instead of n m.
#include <cstdint>
#include <memory>

#include <torch/arg.h>

#include "dtrain/ddp/comm_hook.h"

namespace dtrain::ddp {

struct PowerSGDOptions {
  TORCH_ARG(int64_t, rank) = 1;             // R (at most min(n, m) for each matrix)
  TORCH_ARG(int64_t, warmup_steps) = 10;    // steps averaged uncompressed first
  TORCH_ARG(double, min_compression_rate) = 2.0;
  TORCH_ARG(bool, error_feedback) = true;
  TORCH_ARG(bool, warm_start) = true;       // keep Q from step to step
  TORCH_ARG(uint64_t, seed) = 0;            // of the first Q (bucket b: seed + b)
};

std::shared_ptr<CommHook> powersgd_hook(PowerSGDOptions options);

}  // namespace dtrain::ddp
