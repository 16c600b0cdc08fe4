#pragma once
#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

struct AllReduceOptions {
  TORCH_ARG(ReduceOp, op) = ReduceOp::Sum;
  // false: returns after completion; true: returns at once, call Work::wait().
  TORCH_ARG(bool, async_op) = false;
};

// In place: every rank's `tensor` becomes the reduction over all ranks. Contiguous tensors only.
Work all_reduce(const ProcessGroup& pg, at::Tensor& tensor, const AllReduceOptions& options = {});

// Whether pg's backend reduces `dtype` itself (NCCL: every floating type; libtorch 1.13's Gloo: not
// bf16, which all_reduce then sends as float32).
bool reduces_natively(const ProcessGroup& pg, at::ScalarType dtype);

}  // namespace dtrain::comm
