#pragma once
// Internal pieces shared by the data-parallel wrappers (DistributedDataParallel and
// ShardedDataParallel, FullyShardedDataParallel): what they collect from the wrapped module, the same-model check, the
// broadcast of module state from rank 0, and gradient slots inside flat buckets. Not installed.
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::internal {

struct WrappedTensors {
  std::vector<at::Tensor> all_params;  // every parameter, frozen ones too, in registration order
  std::vector<at::Tensor> params;      // those that require grad (the ones whose gradients move)
  std::vector<std::string> names;      // "module." + name of each of `params`, as in PyTorch
  std::vector<at::Tensor> buffers;
};
WrappedTensors wrapped_tensors(torch::nn::Module& module);

// Checks that every rank built the same model (a clear error naming the rank instead of a hang
// or silently mixed gradients), then, with `broadcast`, copies parameters and buffers from rank 0.
// `wrapper` names the caller in messages ("DistributedDataParallel").
void sync_module_states(const comm::ProcessGroup& pg, const WrappedTensors& t, bool broadcast, const char* wrapper);

// Buffers from rank 0 (before each forward, with broadcast_buffers).
void broadcast_buffers(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& buffers);

// A tensor shaped like `like` (contiguous strides) over `buffer`'s storage from element `offset`.
// Made with set_ rather than narrow/view so that autograd does not treat it as a view: libtorch's
// zero_grad() calls detach_() on gradients, which views refuse.
at::Tensor slot_alias(const at::Tensor& buffer, int64_t offset, const at::Tensor& like);

// Whether `grad` is exactly `slot` (same memory and size).
bool is_slot(const at::Tensor& grad, const at::Tensor& slot);

// "a, b, c ..." from the names of the (at most 10 shown) indices for which `pick(i)` is true.
template <class Pick>
std::string list_names(const std::vector<std::string>& names, Pick pick) {
  std::string out;
  int shown = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    if (!pick(i)) continue;
    if (shown++ == 10) return out + " ...";
    out += (shown > 1 ? ", " : "") + names[i];
  }
  return out;
}

}  // namespace dtrain::internal
