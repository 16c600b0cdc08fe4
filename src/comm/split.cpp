#include "dtrain/comm/split.h"

#include <c10/util/Exception.h>

namespace dtrain::comm {

std::vector<int64_t> even_split(int64_t numel, int parts) {
  TORCH_CHECK(parts >= 1, "even_split: parts must be >= 1, got ", parts);
  TORCH_CHECK(numel >= 0, "even_split: numel must be >= 0, got ", numel);
  std::vector<int64_t> counts(parts, numel / parts);
  for (int i = 0; i < numel % parts; ++i) counts[i] += 1;
  return counts;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

}  // namespace dtrain::comm
