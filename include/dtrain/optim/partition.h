#pragma once
// Which rank owns (keeps optimizer state for, and steps) each parameter under ZeRO-1/2.
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::optim {

struct ParamPartition {
  std::vector<int> owner;               // per parameter (in the order given): its rank
  std::vector<int64_t> elements;        // per rank: elements owned
  std::vector<std::vector<size_t>> by_rank;  // per rank: indices of its parameters, in order
};

// Greedy balance by size, as FairScale's OSS and PyTorch's ZeroRedundancyOptimizer: parameters
// are taken largest first (ties by position) and each goes to the rank with the fewest elements
// so far (ties to the lowest rank). Deterministic, so every rank computes the same partition.
ParamPartition partition_greedy(const std::vector<at::Tensor>& params, int world);

}  // namespace dtrain::optim
