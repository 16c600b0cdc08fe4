#pragma once
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

struct ReduceScatterOptions {
  TORCH_ARG(ReduceOp, op) = ReduceOp::Sum;
  // Elements each rank receives; empty means even_split(input.numel(), size).
  TORCH_ARG(std::vector<int64_t>, counts) = {};
  TORCH_ARG(bool, async_op) = false;
};

// Reduces the flat `input` over ranks and leaves part r (by `counts`) in rank r's `output`.
// On backends without a native reduce-scatter (Gloo in libtorch 1.13) it is an all-to-all of the
// parts followed by a local reduction: each rank sends and receives (W-1)/W of the input, the same
// bytes as a ring reduce-scatter and half of an all-reduce.
Work reduce_scatter(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options = {});

}  // namespace dtrain::comm
