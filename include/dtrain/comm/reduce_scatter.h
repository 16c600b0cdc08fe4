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
  // Where the all-to-all path (below) receives every rank's part: contiguous, the input's dtype and
  // device, at least W x this rank's count elements (the input's size when the parts are even).
  // Without one a buffer is allocated per call; a caller that reduces every step passes one it
  // keeps (Design note [buffers reused], util/block_pool.h). Unused where
  // reduce_scatter_uses_workspace() is false.
  TORCH_ARG(at::Tensor, workspace) = {};
};

// Whether reduce_scatter on `pg` receives the parts into a workspace (Gloo) or reduces natively.
bool reduce_scatter_uses_workspace(const ProcessGroup& pg);

// Reduces the flat `input` over ranks and leaves part r (by `counts`) in rank r's `output`.
// On backends without a native reduce-scatter (Gloo in libtorch 1.13) it is an all-to-all of the
// parts followed by a local reduction: each rank sends and receives (W-1)/W of the input, the same
// bytes as a ring reduce-scatter and half of an all-reduce.
Work reduce_scatter(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options = {});

}  // namespace dtrain::comm
