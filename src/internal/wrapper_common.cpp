#include "wrapper_common.h"

#include <sstream>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/broadcast.h"

namespace dtrain::internal {

WrappedTensors wrapped_tensors(torch::nn::Module& module) {
  WrappedTensors t;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    t.all_params.push_back(item.value());
    if (!item.value().requires_grad()) continue;  // frozen: never reduced
    t.params.push_back(item.value());
    t.names.push_back("module." + item.key());
  }
  for (const auto& b : module.buffers(/*recurse=*/true)) t.buffers.push_back(b);
  return t;
}

namespace {

// Compares (parameter count, shapes, dtypes) by a cheap fingerprint.
void verify_same_model(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& params, const char* wrapper) {
  if (pg.size() == 1) return;
  int64_t h = static_cast<int64_t>(params.size());
  int64_t numel = 0;
  for (const auto& p : params) {
    numel += p.numel();
    for (auto s : p.sizes()) h = h * 1000003 + s;
    h = h * 31 + static_cast<int64_t>(p.scalar_type());
  }
  // On the group's device (NCCL takes CUDA tensors only), compared on the CPU.
  auto mine = at::tensor(std::vector<int64_t>{static_cast<int64_t>(params.size()), numel, h}, at::kLong);
  auto all = at::empty({3 * pg.size()}, at::TensorOptions(at::kLong).device(pg.device()));
  comm::all_gather(pg, all, mine.to(pg.device()));
  all = all.cpu();
  for (int r = 0; r < pg.size(); ++r) {
    auto theirs = all.narrow(0, 3 * r, 3);
    if (!at::equal(theirs, mine)) {
      std::ostringstream os;
      os << pg.describe() << " " << wrapper << ": rank " << pg.global_ranks()[r] << " built a different model ("
         << theirs[0].item<int64_t>() << " parameters, " << theirs[1].item<int64_t>()
         << " elements) than this rank (" << params.size() << " parameters, " << numel
         << " elements); every rank must construct the same module before wrapping it";
      throw std::runtime_error(os.str());
    }
  }
}

void broadcast_from_rank0(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> data;
  data.reserve(tensors.size());
  for (const auto& t : tensors) data.push_back(t.detach());
  at::NoGradGuard no_grad;
  comm::broadcast_coalesced(pg, data, 0);
}

}  // namespace

void sync_module_states(const comm::ProcessGroup& pg, const WrappedTensors& t, bool broadcast, const char* wrapper) {
  verify_same_model(pg, t.all_params, wrapper);
  if (broadcast) {
    std::vector<at::Tensor> state = t.all_params;
    state.insert(state.end(), t.buffers.begin(), t.buffers.end());
    broadcast_from_rank0(pg, state);
  }
}

void broadcast_buffers(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& buffers) {
  if (buffers.empty() || pg.size() == 1) return;
  broadcast_from_rank0(pg, buffers);
}

at::Tensor slot_alias(const at::Tensor& buffer, int64_t offset, const at::Tensor& like) {
  std::vector<int64_t> strides(like.dim(), 1);
  for (int64_t d = like.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * like.size(d + 1);
  at::Tensor alias = at::empty({0}, buffer.options());
  alias.set_(buffer.storage(), buffer.storage_offset() + offset, like.sizes(), strides);
  return alias;
}

bool is_slot(const at::Tensor& grad, const at::Tensor& slot) {
  return grad.defined() && slot.defined() && grad.data_ptr() == slot.data_ptr() && grad.numel() == slot.numel();
}

}  // namespace dtrain::internal
