#include "dtrain/util/autograd_hooks.h"

#include <unordered_set>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace dtrain::util {

namespace {
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::function<void(size_t)> fn, size_t index) : fn_(std::move(fn)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    fn_(index_);
    return outputs;
  }

 private:
  std::function<void(size_t)> fn_;
  size_t index_;
};
}  // namespace

GradReadyHooks::~GradReadyHooks() {
  for (auto& e : hooks_) {
    if (e.accumulator) e.accumulator->del_post_hook(e.key);
  }
}

void GradReadyHooks::add(const at::Tensor& param, size_t index, std::function<void(size_t)> fn) {
  TORCH_CHECK(param.requires_grad() && param.is_leaf(),
              "GradReadyHooks: only leaf tensors that require grad have a gradient accumulator");
  auto acc = torch::autograd::impl::grad_accumulator(param);
  TORCH_CHECK(acc, "GradReadyHooks: no gradient accumulator for a parameter");
  auto key = acc->add_post_hook(std::make_unique<ReadyHook>(std::move(fn), index));
  hooks_.push_back(Entry{std::move(acc), key, index});
}

const torch::autograd::Node* GradReadyHooks::accumulator(size_t index) const {
  return hooks_.at(index).accumulator.get();
}

void BackwardRound::arm(const std::string& who) {
  TORCH_CHECK(phase_ != Phase::Reducing, who, " a forward ran while the previous backward was still reducing gradients");
  phase_ = Phase::Armed;
}

bool BackwardRound::on_hook(std::function<void()> at_end) {
  if (phase_ == Phase::Idle) return false;  // no_sync, or a backward without a synced forward
  if (phase_ == Phase::Armed) {
    phase_ = Phase::Reducing;
    queue_end_of_backward(std::move(at_end));
  }
  return true;
}

void queue_end_of_backward(std::function<void()> fn) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(fn));
}

std::vector<const torch::autograd::Node*> reachable_nodes(const std::vector<at::Tensor>& outputs) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& next : node->next_edges()) {
      if (next.function && seen.insert(next.function.get()).second) stack.push_back(next.function.get());
    }
  }
  return {seen.begin(), seen.end()};
}

}  // namespace dtrain::util
