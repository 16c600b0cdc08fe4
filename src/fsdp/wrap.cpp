#include "dtrain/fsdp/wrap.h"

#include "dtrain/nn/hooked.h"

namespace dtrain::fsdp {

WrapPolicy WrapPolicy::by_size(int64_t min_params) {
  WrapPolicy p{[min_params](const std::string&, torch::nn::Module&, int64_t unwrapped) { return unwrapped >= min_params; }};
  p.skip_unhookable = true;
  return p;
}

WrapPolicy WrapPolicy::modules(std::vector<std::shared_ptr<torch::nn::Module>> list) {
  return {[list = std::move(list)](const std::string&, torch::nn::Module& m, int64_t) {
    for (const auto& x : list) {
      if (x.get() == &m) return true;
    }
    return false;
  }};
}

}  // namespace dtrain::fsdp
