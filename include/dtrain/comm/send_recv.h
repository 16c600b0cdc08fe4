#pragma once
#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

struct SendRecvOptions {
  TORCH_ARG(int, tag) = 0;
  TORCH_ARG(bool, async_op) = false;
};

Work send(const ProcessGroup& pg, const at::Tensor& tensor, int dst, const SendRecvOptions& options = {});
// `src` < 0 receives from any rank.
Work recv(const ProcessGroup& pg, at::Tensor& tensor, int src, const SendRecvOptions& options = {});

}  // namespace dtrain::comm
