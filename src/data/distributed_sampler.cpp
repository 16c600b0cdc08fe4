#include "dtrain/data/distributed_sampler.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace dtrain::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options)
    : dataset_size_(dataset_size), options_(options) {
  const int64_t replicas = options_.num_replicas();
  const int64_t rank = options_.rank();
  TORCH_CHECK(replicas >= 1, "DistributedSampler: num_replicas must be >= 1 (the world size), got ",
              replicas, "; pass DistributedSamplerOptions(world_size, rank)");
  TORCH_CHECK(rank >= 0 && rank < replicas, "DistributedSampler: invalid rank ", rank,
              ", rank must be in the interval [0, ", replicas - 1,
              "]; pass this process's rank in the group of num_replicas = ", replicas, " ranks");
  TORCH_CHECK(dataset_size >= 0, "DistributedSampler: dataset size must be >= 0, got ",
              dataset_size, "; pass the number of samples in the dataset");
  if (options_.drop_last() && dataset_size % replicas != 0) {
    // PyTorch: ceil((n - r) / r), which equals floor(n / r) when r does not divide n (and is 0
    // when n < r).
    num_samples_ = dataset_size / replicas;
  } else {
    num_samples_ = (dataset_size + replicas - 1) / replicas;
  }
  total_size_ = num_samples_ * replicas;
}

void DistributedSampler::set_epoch(int64_t epoch) { epoch_ = epoch; }

std::vector<int64_t> DistributedSampler::indices() const {
  const int64_t n = dataset_size_;
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (options_.shuffle()) {
    // Same as Python: g = torch.Generator(); g.manual_seed(seed + epoch); torch.randperm(n, g).
    // Python's manual_seed reinterprets a negative seed as uint64, as this cast does.
    const auto seed = static_cast<uint64_t>(options_.seed()) + static_cast<uint64_t>(epoch_);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    const int64_t* p = perm.data_ptr<int64_t>();
    std::copy(p, p + n, order.begin());
  } else {
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  }

  // Global list element j (0 <= j < total_size) is order[j % n]: padding repeats the list from
  // its start, cyclically when the padding is longer than the list; drop_last only truncates.
  // This rank takes j = rank, rank + num_replicas, ...
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_samples_));
  const int64_t step = options_.num_replicas();
  for (int64_t j = options_.rank(); j < total_size_; j += step) {
    out.push_back(order[static_cast<size_t>(j % n)]);
  }
  return out;
}

}  // namespace dtrain::data
