#include "dtrain/util/block_pool.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

namespace dtrain::util {

at::DataPtr BlockPool::take(size_t nbytes, c10::Allocator* allocator) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(nbytes);
    if (it != free_.end() && !it->second.empty()) {
      at::DataPtr p = std::move(it->second.back());
      it->second.pop_back();
      held_ -= static_cast<int64_t>(nbytes);
      return p;
    }
  }
  return allocator->allocate(nbytes);
}

void BlockPool::give(at::DataPtr block, size_t nbytes) {
  if (!block || nbytes == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto& list = free_[nbytes];
  if (list.size() >= keep_) return;  // `block` is freed here
  list.push_back(std::move(block));
  held_ += static_cast<int64_t>(nbytes);
}

int64_t BlockPool::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

at::Tensor pooled_empty(int64_t numel, const at::TensorOptions& options, BlockPool* pool) {
  const c10::OptionalDeviceGuard on(options.device_opt());  // (a CUDA allocator allocates on the current device)
  at::Tensor t = at::empty({0}, options);
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  c10::Allocator* allocator = t.storage().allocator();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes,
                       pool ? pool->take(nbytes, allocator) : allocator->allocate(nbytes), allocator,
                       /*resizable=*/false);
  t.set_(storage, 0, {numel}, {1});
  return t;
}

void give_back(const at::Tensor& t, BlockPool* pool) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t n = s->nbytes();
  if (n == 0) return;
  at::DataPtr old = s->set_data_ptr(s->allocator()->allocate(0));
  s->set_nbytes(size_t{0});
  if (pool) pool->give(std::move(old), n);
}

}  // namespace dtrain::util
