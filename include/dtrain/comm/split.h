#pragma once
// How a flat tensor of `numel` elements is split over `parts` ranks when the sizes need not be
// divisible: the first (numel % parts) ranks get one element more (torch.tensor_split's rule).
#include <cstdint>
#include <vector>

namespace dtrain::comm {

std::vector<int64_t> even_split(int64_t numel, int parts);
// Prefix offsets of `counts` (size parts + 1).
std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts);

}  // namespace dtrain::comm
