#include "dtrain/nn/forward_hooks.h"

#include <algorithm>
#include <memory>

#include <c10/util/Exception.h>

namespace dtrain::nn {

uint64_t ForwardHooks::add(HookOrder order, AroundHook hook) {
  TORCH_CHECK(hook, "ForwardHooks::add: empty hook");
  const uint64_t id = next_id_++;
  Entry e{static_cast<int>(order), id, std::move(hook)};
  auto at = std::upper_bound(hooks_.begin(), hooks_.end(), e, [](const Entry& a, const Entry& b) {
    return a.order != b.order ? a.order < b.order : a.id < b.id;
  });
  hooks_.insert(at, std::move(e));
  return id;
}

void ForwardHooks::remove(uint64_t id) {
  hooks_.erase(std::remove_if(hooks_.begin(), hooks_.end(), [id](const Entry& e) { return e.id == id; }),
               hooks_.end());
}

size_t ForwardHooks::remove_all(HookOrder order) {
  const size_t before = hooks_.size();
  hooks_.erase(std::remove_if(hooks_.begin(), hooks_.end(), [order](const Entry& e) { return e.order == static_cast<int>(order); }),
               hooks_.end());
  return before - hooks_.size();
}

bool ForwardHooks::has(HookOrder order) const {
  return std::any_of(hooks_.begin(), hooks_.end(), [order](const Entry& e) { return e.order == static_cast<int>(order); });
}

namespace {
// The chain and the body are shared and captured by value: a hook may keep `next` beyond the call
// (recomputation replays it in backward).
using Chain = std::shared_ptr<const std::vector<AroundHook>>;
Tensors run_from(const Chain& chain, size_t i, const Tensors& inputs, const std::shared_ptr<const ForwardBody>& body) {
  if (i == chain->size()) return (*body)(inputs);
  return (*chain)[i](inputs, [chain, i, body](const Tensors& in) { return run_from(chain, i + 1, in, body); });
}
}  // namespace

Tensors ForwardHooks::run(const Tensors& inputs, const ForwardBody& body) const {
  if (hooks_.empty()) return body(inputs);
  auto chain = std::make_shared<std::vector<AroundHook>>();
  chain->reserve(hooks_.size());
  for (const auto& e : hooks_) chain->push_back(e.hook);
  return run_from(chain, 0, inputs, std::make_shared<const ForwardBody>(body));
}

}  // namespace dtrain::nn
