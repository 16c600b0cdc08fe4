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
};

// Gathers every rank's `input` into one flat `output` (rank r's part at offset sum(counts[:r])).
// Uneven counts work. Moves no more than one output's worth of bytes per rank (plus padding to
// the largest count for uneven counts on backends without a variable-size all-gather).
Work all_gather(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                const AllGatherOptions& options = {});

// Every rank's `mine` (any bytes), on every rank in rank order: two all-gathers (lengths, then
// bytes) through the group's device (NCCL takes CUDA tensors only).
std::vector<std::string> all_gather_text(const ProcessGroup& pg, const std::string& mine);

}  // namespace dtrain::comm
