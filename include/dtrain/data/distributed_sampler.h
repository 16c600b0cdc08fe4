#pragma once
// DistributedSampler: the per-rank index list of torch.utils.data.DistributedSampler, index for
// index (same shuffle, same padding, same drop_last rule), so a C++ rank and a Python rank that
// share (dataset size, num_replicas, seed, epoch) read exactly the same samples.
//
//   dtrain::data::DistributedSampler sampler(dataset.size(),
//       dtrain::data::DistributedSamplerOptions(world, rank).seed(1234));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);                  // reshuffles (same order on every rank)
//     for (int64_t i : sampler.indices()) ...;   // num_samples() indices, this rank's share
//   }
//
// Semantics (identical to PyTorch):
// - shuffle: the order is at::randperm(n) drawn from a CPU generator seeded with seed + epoch,
//   otherwise 0, 1, ..., n-1.
// - drop_last = false: num_samples = ceil(n / num_replicas); the list is padded to
//   total_size = num_samples * num_replicas by repeating it from its start (cyclically when the
//   padding is longer than the dataset, e.g. n = 1 on 4 replicas gives every rank index 0).
// - drop_last = true: num_samples = floor(n / num_replicas); the tail beyond total_size is dropped.
// - rank r takes positions r, r + num_replicas, r + 2 * num_replicas, ... of that list.
// - n = 0 gives every rank an empty list.
#include <cstdint>
#include <vector>

#include <torch/arg.h>

namespace dtrain::data {

struct DistributedSamplerOptions {
  DistributedSamplerOptions() = default;
  DistributedSamplerOptions(int64_t num_replicas, int64_t rank)
      : num_replicas_(num_replicas), rank_(rank) {}

  // Number of ranks sharing the dataset (the world size); must be >= 1.
  TORCH_ARG(int64_t, num_replicas) = 1;
  // This rank, in [0, num_replicas).
  TORCH_ARG(int64_t, rank) = 0;
  // Shuffle with a generator seeded with seed + epoch (the same permutation on every rank).
  TORCH_ARG(bool, shuffle) = true;
  // Must be identical on every rank. Negative values wrap as in torch.Generator.manual_seed.
  TORCH_ARG(int64_t, seed) = 0;
  // Drop the tail so every rank gets floor(n / num_replicas) samples instead of padding.
  TORCH_ARG(bool, drop_last) = false;
};

class DistributedSampler {
 public:
  // dataset_size: number of samples in the dataset (>= 0). Throws c10::Error on invalid options.
  DistributedSampler(int64_t dataset_size, DistributedSamplerOptions options = {});

  // Selects the shuffle of `epoch`; call it at the start of every epoch (all ranks alike).
  void set_epoch(int64_t epoch);
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch: num_samples() values in [0, dataset_size).
  std::vector<int64_t> indices() const;

  // Indices per rank per epoch (len(sampler) in PyTorch).
  int64_t num_samples() const { return num_samples_; }
  // num_samples() * num_replicas: the padded / truncated length of the global list.
  int64_t total_size() const { return total_size_; }
  int64_t dataset_size() const { return dataset_size_; }
  const DistributedSamplerOptions& options() const { return options_; }

 private:
  int64_t dataset_size_;
  DistributedSamplerOptions options_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
  int64_t total_size_ = 0;
};

}  // namespace dtrain::data
