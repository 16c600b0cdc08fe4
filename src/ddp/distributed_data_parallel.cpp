#include "dtrain/ddp/distributed_data_parallel.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "../internal/wrapper_common.h"

namespace dtrain::ddp {

DataParallelState::DataParallelState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg,
                                     DistributedDataParallelOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options) {
  TORCH_CHECK(module_, "DistributedDataParallel: no module given");
  TORCH_CHECK(pg_.is_member(), "DistributedDataParallel: this rank is not a member of the process group");
  internal::WrappedTensors tensors = internal::wrapped_tensors(*module_);
  buffers_ = tensors.buffers;
  internal::sync_module_states(pg_, tensors, options_.sync_module_states(), "DistributedDataParallel");
  reducer_ = std::make_unique<Reducer>(
      std::move(tensors.params), std::move(tensors.names), pg_,
      ReducerOptions()
          .bucket_cap_bytes(static_cast<int64_t>(options_.bucket_cap_mb() * (1 << 20)))
          .first_bucket_cap_bytes(static_cast<int64_t>(options_.first_bucket_cap_mb() * (1 << 20)))
          .find_unused_parameters(options_.find_unused_parameters())
          .gradient_as_bucket_view(options_.gradient_as_bucket_view())
          .comm_hook(options_.comm_hook())
          .hierarchical_all_reduce(options_.hierarchical_all_reduce()));
}

void DataParallelState::before_forward() {
  if (options_.broadcast_buffers()) internal::broadcast_buffers(pg_, buffers_);
}

void DataParallelState::after_forward(const std::vector<at::Tensor>& outputs) {
  if (sync_ && c10::GradMode::is_enabled()) {
    reducer_->prepare_for_backward(outputs);
  }
}

}  // namespace dtrain::ddp
