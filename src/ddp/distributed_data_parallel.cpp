#include "dtrain/ddp/distributed_data_parallel.h"

#include <sstream>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/broadcast.h"

namespace dtrain::ddp {

namespace {

// Every rank must wrap the same model: compare (parameter count, shapes, dtypes) by a cheap
// fingerprint, so a mismatch is a clear error instead of a hang or silently mixed gradients.
void verify_same_model(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& params,
                       const std::vector<std::string>& names) {
  if (pg.size() == 1) return;
  int64_t h = static_cast<int64_t>(params.size());
  int64_t numel = 0;
  for (const auto& p : params) {
    numel += p.numel();
    for (auto s : p.sizes()) h = h * 1000003 + s;
    h = h * 31 + static_cast<int64_t>(p.scalar_type());
  }
  auto mine = at::tensor(std::vector<int64_t>{static_cast<int64_t>(params.size()), numel, h}, at::kLong);
  auto all = at::empty({3 * pg.size()}, at::kLong);
  comm::all_gather(pg, all, mine);
  for (int r = 0; r < pg.size(); ++r) {
    auto theirs = all.narrow(0, 3 * r, 3);
    if (!at::equal(theirs, mine)) {
      std::ostringstream os;
      os << pg.describe() << " DistributedDataParallel: rank " << pg.global_ranks()[r]
         << " built a different model (" << theirs[0].item<int64_t>() << " parameters, "
         << theirs[1].item<int64_t>() << " elements) than this rank (" << params.size() << " parameters, "
         << numel << " elements); every rank must construct the same module before wrapping it";
      throw std::runtime_error(os.str());
    }
  }
}

}  // namespace

DataParallelState::DataParallelState(torch::nn::Module& module, comm::ProcessGroup pg,
                                     DistributedDataParallelOptions options)
    : module_(module), pg_(std::move(pg)), options_(options) {
  TORCH_CHECK(pg_.is_member(), "DistributedDataParallel: this rank is not a member of the process group");
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<at::Tensor> all_params;
  for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
    all_params.push_back(item.value());
    if (!item.value().requires_grad()) continue;  // frozen: never reduced
    params.push_back(item.value());
    names.push_back("module." + item.key());
  }
  for (const auto& b : module_.buffers(/*recurse=*/true)) buffers_.push_back(b);
  verify_same_model(pg_, all_params, names);
  if (options_.sync_module_states()) {
    std::vector<at::Tensor> state = all_params;
    state.insert(state.end(), buffers_.begin(), buffers_.end());
    std::vector<at::Tensor> data;
    for (auto& t : state) data.push_back(t.detach());
    at::NoGradGuard no_grad;
    comm::broadcast_coalesced(pg_, data, 0);
  }
  reducer_ = std::make_unique<Reducer>(
      params, names, pg_,
      ReducerOptions()
          .bucket_cap_bytes(static_cast<int64_t>(options_.bucket_cap_mb() * (1 << 20)))
          .first_bucket_cap_bytes(static_cast<int64_t>(options_.first_bucket_cap_mb() * (1 << 20)))
          .find_unused_parameters(options_.find_unused_parameters())
          .gradient_as_bucket_view(options_.gradient_as_bucket_view()));
}

void DataParallelState::before_forward() {
  if (options_.broadcast_buffers() && !buffers_.empty() && pg_.size() > 1) {
    std::vector<at::Tensor> data;
    for (auto& t : buffers_) data.push_back(t.detach());
    at::NoGradGuard no_grad;
    comm::broadcast_coalesced(pg_, data, 0);
  }
}

void DataParallelState::after_forward(const std::vector<at::Tensor>& outputs) {
  if (sync_ && c10::GradMode::is_enabled()) {
    reducer_->prepare_for_backward(outputs);
  }
}

}  // namespace dtrain::ddp
