#pragma once
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

struct BroadcastOptions {
  TORCH_ARG(int, src) = 0;  // group rank whose tensor everyone receives
  TORCH_ARG(bool, async_op) = false;
};

Work broadcast(const ProcessGroup& pg, at::Tensor& tensor, const BroadcastOptions& options = {});

// Broadcasts many tensors (of one dtype each bucket) through a few flat buffers of at most
// `bucket_bytes`, then copies them back in place. Used for parameters and buffers.
// `scratch` (optional): a flat buffer kept across calls (e.g. one per owner in ZeRO's step): a bucket
// of its dtype and device that fits uses its front instead of a new buffer, and a larger one
// replaces it. One buffer reused, rather than one freed and another allocated at once, keeps the
// peak deterministic: Gloo's worker thread may still hold the previous buffer for a moment after
// the broadcast has completed.
void broadcast_coalesced(const ProcessGroup& pg, std::vector<at::Tensor> tensors, int src = 0,
                         int64_t bucket_bytes = 64 << 20, at::Tensor* scratch = nullptr);

}  // namespace dtrain::comm
