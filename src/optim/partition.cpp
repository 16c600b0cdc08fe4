#include "dtrain/optim/partition.h"

#include <algorithm>
#include <numeric>

#include <c10/util/Exception.h>

namespace dtrain::optim {

ParamPartition partition_greedy(const std::vector<at::Tensor>& params, int world) {
  TORCH_CHECK(world >= 1, "partition_greedy: world size must be >= 1, got ", world);
  std::vector<size_t> order(params.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return params[a].numel() > params[b].numel(); });
  ParamPartition p;
  p.owner.assign(params.size(), 0);
  p.elements.assign(world, 0);
  p.by_rank.assign(world, {});
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(p.elements.begin(), p.elements.end()) - p.elements.begin());
    p.owner[i] = r;
    p.elements[r] += params[i].numel();
  }
  for (size_t i = 0; i < params.size(); ++i) p.by_rank[p.owner[i]].push_back(i);
  return p;
}

}  // namespace dtrain::optim
