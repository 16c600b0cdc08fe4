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
  bool bad = false;
  const double inv = 1.0 / state_.scale;
  at::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    at::Tensor g = p.grad();
    if (!bad && !at::isfinite(g).all().item<bool>()) bad = true;
    g.mul_(inv);
  }
  if (pg_ && pg_->size() > 1) {
    auto flag = at::full({1}, bad ? 1.0f : 0.0f);
    comm::all_reduce(*pg_, flag, comm::AllReduceOptions().op(comm::ReduceOp::Max));
    bad = flag.item<float>() > 0;
  }
  found_inf_ = bad;
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
