#include "dtrain/tensor_parallel/dropout.h"

#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace dtrain::tensor_parallel {

namespace {
void check_p(double p) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "tensor parallel dropout: p must be in [0, 1), got ", p);
}

// SplitMix64's finaliser: distinct, well-mixed seeds for (seed, head).
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
}  // namespace

// Design note [dropout streams] (dropout.h).
at::Tensor dropout(const at::Tensor& x, double p, bool training) {
  check_p(p);
  if (!training || p == 0.0) return x;
  return x * at::empty(x.sizes(), x.options().requires_grad(false)).bernoulli_(1.0 - p).div_(1.0 - p);
}

at::Tensor dropout_replicated(const at::Tensor& x, double p, bool training, const comm::ProcessGroup& tp,
                              int64_t sequence_dim) {
  if (sequence_dim < 0) return tensor_parallel::dropout(x, p, training);
  check_p(p);
  if (!training || p == 0.0) return x;
  auto shape = x.sizes().vec();
  shape[sequence_dim] *= tp.size();
  at::Tensor keep = at::empty(shape, x.options().requires_grad(false)).bernoulli_(1.0 - p);
  keep = keep.narrow(sequence_dim, tp.rank() * x.size(sequence_dim), x.size(sequence_dim));
  return x * keep.div_(1.0 - p);
}

at::Tensor dropout_heads(const at::Tensor& x, double p, bool training, int64_t first_head) {
  check_p(p);
  if (!training || p == 0.0) return x;
  TORCH_CHECK(x.dim() >= 2, "tensor parallel dropout_heads: expected [B, heads, ...], got ", x.sizes());
  uint64_t seed = 0;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    seed = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
  }
  auto head_shape = x.sizes().vec();
  head_shape.erase(head_shape.begin() + 1);  // [B, ...]
  std::vector<at::Tensor> masks;
  for (int64_t j = 0; j < x.size(1); ++j) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(mix(seed ^ mix(static_cast<uint64_t>(first_head + j))));
    masks.push_back(at::empty(head_shape, at::kFloat).bernoulli_(1.0 - p, gen));
  }
  const at::Tensor keep = at::stack(masks, 1).to(x.options().requires_grad(false)).div_(1.0 - p);
  return x * keep;
}

}  // namespace dtrain::tensor_parallel
