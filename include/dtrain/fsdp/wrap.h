#pragma once
// Which submodules become FSDP units (each gathers, frees and reduces its parameters together),
// as PyTorch's auto_wrap_policy. The root is always a unit and takes every parameter no nested unit
// takes. A nested unit must run its forward through forward hooks: a dtrain::nn::Hookable module, a
// dtrain::nn::Hooked<...> member, or a stock layer inside a torch::nn::Sequential, which FSDP
// upgrades in place (Design note [hooked modules], dtrain/nn/hooked.h); FSDP reports any other
// module a policy picks.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace dtrain::fsdp {

struct WrapPolicy {
  // (path in the model, module, parameters of its subtree not already in a nested unit) -> wrap?
  // Asked bottom-up (children before parents), never for the root.
  std::function<bool(const std::string& name, torch::nn::Module& module, int64_t unwrapped_params)> fn;
  // Modules that cannot get forward hooks where they are (nn::can_hook_in) are passed over instead
  // of being an error (by_size: it picks by size, not by kind).
  bool skip_unhookable = false;

  // Nothing nested: the whole model is one unit.
  static WrapPolicy none() { return {}; }
  // Every module of type T (e.g. a transformer block), as transformer_auto_wrap_policy.
  template <class T>
  static WrapPolicy by_type() {
    return {[](const std::string&, torch::nn::Module& m, int64_t) { return dynamic_cast<T*>(&m) != nullptr; }};
  }
  // Every module whose not-yet-wrapped parameters reach `min_params`, as size_based_auto_wrap_policy
  // (only modules that can be units where they are: Hookable ones, Hooked members, registered
  // stock layers inside a Sequential).
  static WrapPolicy by_size(int64_t min_params);
  // Exactly these modules (manual wrapping).
  static WrapPolicy modules(std::vector<std::shared_ptr<torch::nn::Module>> list);
};

}  // namespace dtrain::fsdp
