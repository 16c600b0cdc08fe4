// ForeachAdamW: Design note [multi-tensor AdamW] in dtrain/optim/adamw.h.
#include "dtrain/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include <ATen/ATen.h>
#include "dtrain/compat.h"
#include <torch/autograd.h>

namespace dtrain::optim {

namespace {

// The tensors of one group's parameters that step together (the same step count after this step).
struct Batch {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
};

// `whole` cut into runs of consecutive tensors of at most twice the largest tensor's elements each:
// the step's one foreach temporary (the denominators) then never exceeds the two temporaries
// libtorch's one-tensor-at-a-time AdamW allocates for its largest parameter, so the step's peak
// memory is what the memory planner counts, while small tensors (biases, norms) and pairs of large
// ones step together.
std::vector<Batch> chunks(const Batch& whole) {
  int64_t cap = 0;
  for (const auto& p : whole.params) cap = std::max<int64_t>(cap, 2 * p.numel());
  std::vector<Batch> out(1);
  int64_t filled = 0;
  for (size_t i = 0; i < whole.params.size(); ++i) {
    if (filled > 0 && filled + whole.params[i].numel() > cap) {
      out.emplace_back();
      filled = 0;
    }
    Batch& b = out.back();
    b.params.push_back(whole.params[i]);
    b.grads.push_back(whole.grads[i]);
    b.exp_avgs.push_back(whole.exp_avgs[i]);
    b.exp_avg_sqs.push_back(whole.exp_avg_sqs[i]);
    filled += whole.params[i].numel();
  }
  return out;
}

// PyTorch's foreach AdamW (torch/optim/adamw.py, _multi_tensor_adamw), operation for operation, on
// one chunk: libtorch's arithmetic except the first moment, a lerp (one pass) where libtorch
// multiplies and adds (two).
void step_chunk(Batch& b, int64_t step, const torch::optim::AdamWOptions& options, double beta1, double beta2) {
  if (options.weight_decay() != 0) at::_foreach_mul_(b.params, 1 - options.lr() * options.weight_decay());
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  compat::foreach_lerp_(b.exp_avgs, b.grads, 1 - beta1);
  at::_foreach_mul_(b.exp_avg_sqs, beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, b.grads, b.grads, 1 - beta2);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(b.exp_avg_sqs);
  at::_foreach_div_(denom, std::sqrt(bias_correction2));
  at::_foreach_add_(denom, options.eps());
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, -options.lr() / bias_correction1);
}

}  // namespace

torch::Tensor ForeachAdamW::step(LossClosure closure) {
  for (auto& group : param_groups_) {  // (amsgrad, rare: libtorch's own step, one tensor at a time)
    if (static_cast<torch::optim::AdamWOptions&>(group.options()).amsgrad()) return torch::optim::AdamW::step(closure);
  }
  torch::NoGradGuard no_grad;
  torch::Tensor loss = {};
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    auto& options = static_cast<torch::optim::AdamWOptions&>(group.options());
    std::map<int64_t, Batch> batches;  // by step count; one entry unless parameters joined late
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
      const auto key = compat::optimizer_state_key<std::decay_t<decltype(state_)>>(p);
      if (!state_.count(key)) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        state_[key] = std::move(fresh);
      }
      auto& state = static_cast<torch::optim::AdamWParamState&>(*state_[key]);
      state.step(state.step() + 1);
      Batch& b = batches[state.step()];
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(state.exp_avg());
      b.exp_avg_sqs.push_back(state.exp_avg_sq());
    }
    const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
    for (auto& [step, whole] : batches) {
      for (Batch& b : chunks(whole)) step_chunk(b, step, options, beta1, beta2);
    }
  }
  return loss;
}

}  // namespace dtrain::optim
