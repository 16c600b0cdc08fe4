#pragma once
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

struct AllToAllOptions {
  // Rows (dim 0) sent to / received from each rank; empty means equal splits.
  TORCH_ARG(std::vector<int64_t>, input_split_sizes) = {};
  TORCH_ARG(std::vector<int64_t>, output_split_sizes) = {};
  TORCH_ARG(bool, async_op) = false;
};

Work all_to_all(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                const AllToAllOptions& options = {});

}  // namespace dtrain::comm
