#include "dtrain/recompute/checkpoint.h"

#include "dtrain/nn/hooked.h"

#include "dtrain/amp/autocast.h"
#include "dtrain/compat.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace dtrain::recompute {

namespace {

// The random state of the CPU and of every other device the call's tensors live on (as
// torch.utils.checkpoint's preserve_rng_state: a CUDA dropout mask comes from that device's
// generator), each read and set under its generator's own lock.
class RngStates {
 public:
  // The generators a call on `a` and `b` may draw from: the CPU's, and that of each device (type
  // and index) a defined tensor of theirs is on.
  static RngStates of(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto* list : {&a, &b}) {
      for (const auto& t : *list) {
        if (t.defined() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
          devices.push_back(t.device());
        }
      }
    }
    return capture(devices);
  }
  // The current state of the same generators.
  RngStates current() const {
    std::vector<c10::Device> devices;
    for (const auto& s : states_) devices.push_back(s.first);
    return capture(devices);
  }
  void restore() const {
    for (const auto& [d, state] : states_) {
      auto gen = generator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }

 private:
  static RngStates capture(const std::vector<c10::Device>& devices) {
    RngStates s;
    for (const auto& d : devices) {
      auto gen = generator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.states_.emplace_back(d, gen.get_state());
    }
    return s;
  }
  static at::Generator generator(const c10::Device& d) {
    return d.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(d);
  }
  std::vector<std::pair<c10::Device, at::Tensor>> states_;
};

// See Design note [recompute node] in checkpoint.h. next_edges: inputs..., params...
class RecomputeNode : public torch::autograd::Node {
 public:
  RecomputeNode(Fn fn, std::vector<at::Tensor> inputs, std::vector<at::Tensor> params, RngStates rng)
      : fn_(std::move(fn)), inputs_(std::move(inputs)), params_(std::move(params)), rng_(std::move(rng)),
        autocast_cpu_(amp::AutocastState::current(c10::kCPU)),
        autocast_cuda_(amp::AutocastState::current(c10::kCUDA)) {}

  std::string name() const override { return "dtrain::recompute::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grad_outputs) override {
    TORCH_CHECK(fn_, "dtrain::recompute::checkpoint: backward ran twice through the same checkpoint; "
                     "recomputation frees its inputs after one backward (retain_graph is not supported)");
    // Re-run the call with the forward's random state, then put the current state back.
    const RngStates now = rng_.current();
    rng_.restore();
    std::vector<at::Tensor> detached;
    for (const auto& x : inputs_) {
      detached.push_back(x.defined() ? x.detach().requires_grad_(x.requires_grad()) : x);
    }
    std::vector<at::Tensor> outputs;
    {
      // The forward's autocast settings too, so the recomputed activations are the same.
      amp::AutocastGuard cpu(c10::kCPU, autocast_cpu_);
      amp::AutocastGuard cuda(c10::kCUDA, autocast_cuda_);
      at::AutoGradMode enable(true);
      outputs = fn_(detached);
    }
    now.restore();
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "dtrain::recompute::checkpoint: the recomputation returned ",
                outputs.size(), " tensors, the forward ", grad_outputs.size(), "; the function must be deterministic");
    // Gradients of every input and parameter that requires one.
    std::vector<at::Tensor> roots, root_grads, wrt;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    std::vector<int> slot;  // position in the result for each entry of wrt
    for (size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].defined() && detached[i].requires_grad()) {
        wrt.push_back(detached[i]);
        slot.push_back(static_cast<int>(i));
      }
    }
    for (size_t j = 0; j < params_.size(); ++j) {
      if (params_[j].requires_grad()) {
        wrt.push_back(params_[j]);
        slot.push_back(static_cast<int>(inputs_.size() + j));
      }
    }
    torch::autograd::variable_list result(inputs_.size() + params_.size());
    if (!roots.empty() && !wrt.empty()) {
      auto grads = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                         /*allow_unused=*/true);
      for (size_t k = 0; k < grads.size(); ++k) result[slot[k]] = grads[k];
    }
    fn_ = nullptr;  // free the saved inputs with the function's captures
    inputs_.clear();
    return result;
  }

 private:
  Fn fn_;
  std::vector<at::Tensor> inputs_;
  std::vector<at::Tensor> params_;
  RngStates rng_;
  amp::AutocastState autocast_cpu_, autocast_cuda_;
};

}  // namespace

std::vector<at::Tensor> checkpoint(const Fn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params) {
  TORCH_CHECK(fn, "dtrain::recompute::checkpoint: no function given");
  bool needs_grad = false;
  for (const auto& t : inputs) needs_grad |= t.defined() && t.requires_grad();
  for (const auto& p : params) needs_grad |= p.requires_grad();
  if (!at::GradMode::is_enabled() || !needs_grad) return fn(inputs);  // nothing to recompute for

  RngStates rng = RngStates::of(inputs, params);
  std::vector<at::Tensor> outputs;
  {
    at::NoGradGuard no_grad;
    outputs = fn(inputs);
  }
  std::vector<at::Tensor> saved;
  for (const auto& x : inputs) saved.push_back(x.defined() ? x.detach().requires_grad_(x.requires_grad()) : x);
  compat::NodePtr node = compat::make_node<RecomputeNode>(fn, saved, params, std::move(rng));
  std::vector<at::Tensor> edges_of = inputs;
  edges_of.insert(edges_of.end(), params.begin(), params.end());
  node->set_next_edges(torch::autograd::collect_next_edges(edges_of));
  for (auto& out : outputs) {
    if (out.defined() && out.is_view()) {
      at::NoGradGuard no_grad;
      out = out.clone();  // a view (e.g. of an input) must not take the node as its history
    }
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type())) {
      torch::autograd::set_history(out, node);
    } else {
      // Keeps output numbering aligned with grad_outputs in backward.
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
  return outputs;
}

uint64_t checkpoint_forward(torch::nn::Module& module) {
  auto* hookable = dynamic_cast<nn::Hookable*>(&module);
  TORCH_CHECK(hookable, "recompute::checkpoint_forward: module ", module.name(),
              " does not run its forward through dtrain::nn::Hookable (Design note [forward hooks]); "
              "use recompute::checkpoint_modules(root, picker), which gives stock layers in a Sequential hooks in "
              "place, or declare the member as dtrain::nn::Hooked<...> (Design note [hooked modules])");
  TORCH_CHECK(!hookable->forward_hooks().has(nn::HookOrder::Recompute), "recompute::checkpoint_forward: ", module.name(),
              " is checkpointed already (a second recomputation hook would replay it twice)");
  torch::nn::Module* m = &module;  // the hook lives inside the module: a plain pointer cannot dangle
  return hookable->forward_hooks().add(nn::HookOrder::Recompute, [m](const nn::Tensors& in, const nn::ForwardBody& next) {
    if (!m->is_training()) return next(in);
    return checkpoint(next, in, m->parameters());
  });
}

namespace {
void checkpoint_under(torch::nn::Module& parent, const std::string& prefix, const ModulePicker& pick, int64_t& count) {
  for (const auto& item : parent.named_children()) {
    const std::string path = prefix.empty() ? item.key() : prefix + "." + item.key();
    torch::nn::Module& child = *item.value();
    if (pick(path, child)) {
      torch::nn::Module* hooked = nullptr;
      try {
        hooked = &nn::make_hookable(parent, item.key(), child, path);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "recompute::checkpoint_modules: ", e.what_without_backtrace());
      }
      // Already recomputed (checkpointed by hand, or a second make_parallel): leave it as it is.
      if (!dynamic_cast<nn::Hookable*>(hooked)->forward_hooks().has(nn::HookOrder::Recompute)) checkpoint_forward(*hooked);
      ++count;
    } else {
      checkpoint_under(child, path, pick, count);
    }
  }
}
}  // namespace

int64_t checkpoint_modules(torch::nn::Module& root, const ModulePicker& pick) {
  TORCH_CHECK(pick, "recompute::checkpoint_modules: no picker given");
  int64_t count = 0;
  checkpoint_under(root, "", pick, count);
  TORCH_CHECK(count > 0, "recompute::checkpoint_modules: the picker selected no module of ", root.name(),
              ", so nothing would be recomputed; pick the model's repeated layers (e.g. recompute::of_type<Block>())");
  return count;
}

int64_t stop_recomputing(torch::nn::Module& root) {
  int64_t count = 0;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    if (auto* h = dynamic_cast<nn::Hookable*>(m.get())) count += h->forward_hooks().remove_all(nn::HookOrder::Recompute) > 0;
  }
  return count;
}

}  // namespace dtrain::recompute
