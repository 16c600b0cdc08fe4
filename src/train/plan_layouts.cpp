#include "dtrain/train/plan_layouts.h"

namespace dtrain::train::detail {

std::vector<Layout> model_parallel_layouts(int world) {
  std::vector<Layout> out;
  for (int tp = 2; tp <= world; ++tp) {
    if (world % tp == 0) out.insert(out.end(), {{tp, false, 1}, {tp, true, 1}});
  }
  for (int pp = 2; pp <= world; ++pp) {
    if (world % pp == 0) out.push_back({1, false, pp});
  }
  for (int tp = 2; tp <= world; ++tp) {
    for (int pp = 2; tp * pp <= world; ++pp) {
      if (world % (tp * pp) == 0) out.push_back({tp, false, pp});
    }
  }
  return out;
}

}  // namespace dtrain::train::detail
