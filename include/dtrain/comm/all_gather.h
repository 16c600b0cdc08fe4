#pragma once
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

struct AllGatherOptions {
  // Elements contributed by each rank; empty means every rank contributes input.numel().
  TORCH_ARG(std::vector<int64_t>, counts) = {};
  TORCH_ARG(bool, async_op) = false;
  // Gloo's all-gather allocates a flat output of its own per call and copies out of it (c10d's
  // ProcessGroupGloo, 1.13 and 2.x). Given a workspace (contiguous, the input's dtype and device,
  // at least W x input.numel() elements), an all-gather on such a backend (uneven counts too,
  // without padding) is instead an all-to-all straight into `output`, of the input copied W times
  // into the workspace: the same
  // bytes on the wire and one copy as before, and no allocation for a caller that keeps its
  // workspace (Design note [buffers reused], util/block_pool.h). Every rank of the group passes
  // one, or none (the two are different collectives; DTRAIN_DEBUG=1 checks it). Unused where
  // all_gather_uses_workspace() is false.
  TORCH_ARG(at::Tensor, workspace) = {};
};

// Whether all_gather on `pg` uses a workspace given in its options (Gloo) or gathers in place.
bool all_gather_uses_workspace(const ProcessGroup& pg);

// Gathers every rank's `input` into one flat `output` (rank r's part at offset sum(counts[:r])).
// Uneven counts work. Each rank sends its input to each other rank (W - 1 copies of it; plus
// padding to the largest count for uneven counts without a workspace on Gloo, or on NCCL).
Work all_gather(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                const AllGatherOptions& options = {});

// Every rank's `mine` (any bytes), on every rank in rank order: two all-gathers (lengths, then
// bytes) through the group's device (NCCL takes CUDA tensors only).
std::vector<std::string> all_gather_text(const ProcessGroup& pg, const std::string& mine);

}  // namespace dtrain::comm
