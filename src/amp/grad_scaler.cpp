#include "dtrain/amp/grad_scaler.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/all_reduce.h"

namespace dtrain::amp {

GradScaler::GradScaler(GradScalerOptions options, std::optional<comm::ProcessGroup> pg)
    : options_(options), pg_(std::move(pg)) {
  TORCH_CHECK(options_.init_scale() > 0, "GradScaler: init_scale must be positive");
  TORCH_CHECK(options_.growth_factor() > 1.0, "GradScaler: growth_factor must be > 1");
  TORCH_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1.0, "GradScaler: backoff_factor must be in (0, 1)");
  TORCH_CHECK(options_.growth_interval() >= 1, "GradScaler: growth_interval must be >= 1");
  state_.scale = options_.init_scale();
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  return loss * state_.scale;
}

void GradScaler::unscale(const std::vector<at::Tensor>& params) {
  if (!options_.enabled()) return;
  TORCH_CHECK(stage_ == Stage::Ready, "GradScaler: unscale() was already called since the last update(); call it "
                                      "once per step, after backward and before step()");
  // Design note [device-side inf check]: per gradient, two passes over its elements (the in-place
  // unscale and an fp32 sum: a sum is inf/NaN when any term is, so no boolean tensor is made), and
  // the sums stay on the device until the one read at the end (one host sync per step on CUDA,
  // not one per gradient). A finite gradient whose fp32 sum overflows (|sum| > 3.4e38) counts as
  // inf too: such a step is not worth taking either. The agreement all-reduce runs on the process
  // group's device (NCCL moves CUDA tensors only; with FSDP's cpu_offload the gradients are on
  // the CPU and the group on the GPU).
  const double inv = 1.0 / state_.scale;
  at::NoGradGuard no_grad;
  const c10::Device where = pg_ ? pg_->device() : c10::Device(c10::kCPU);
  std::vector<at::Tensor> sums;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad();
    g.mul_(inv);
    sums.push_back(at::sum(g, at::kFloat).to(where));
  }
  at::Tensor flag = sums.empty() ? at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(where))
                                 : at::logical_not(at::isfinite(at::stack(sums))).any().to(at::kFloat).reshape({1});
  if (pg_ && pg_->size() > 1) comm::all_reduce(*pg_, flag, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  found_inf_ = flag.item<float>() > 0;
  stage_ = Stage::Unscaled;
}

bool GradScaler::step(const std::function<void()>& optimizer_step, const std::vector<at::Tensor>& params) {
  if (!options_.enabled()) {
    optimizer_step();
    return true;
  }
  TORCH_CHECK(stage_ != Stage::Stepped, "GradScaler: step() was already called since the last update()");
  if (stage_ == Stage::Ready) unscale(params);
  stage_ = Stage::Stepped;
  if (found_inf_) return false;
  optimizer_step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  TORCH_CHECK(stage_ == Stage::Stepped, "GradScaler: update() needs a step() first in this step");
  if (found_inf_) {
    state_.scale *= options_.backoff_factor();
    state_.growth_tracker = 0;
  } else if (++state_.growth_tracker == options_.growth_interval()) {
    state_.scale *= options_.growth_factor();
    state_.growth_tracker = 0;
  }
  stage_ = Stage::Ready;
  found_inf_ = false;
}

void GradScaler::load_state(const GradScalerState& s) {
  TORCH_CHECK(s.scale > 0 && std::isfinite(s.scale), "GradScaler: loaded scale ", s.scale, " must be positive and finite");
  TORCH_CHECK(s.growth_tracker >= 0 && s.growth_tracker < options_.growth_interval(), "GradScaler: loaded growth_tracker ",
              s.growth_tracker, " must be in [0, growth_interval = ", options_.growth_interval(), ")");
  state_ = s;
  stage_ = Stage::Ready;
  found_inf_ = false;
}

}  // namespace dtrain::amp
