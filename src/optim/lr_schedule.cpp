#include "dtrain/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include <torch/optim/optimizer.h>

namespace dtrain::optim {

void LrSchedule::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (warmup_steps < 0) fail("--warmup-steps " + std::to_string(warmup_steps) + " is negative: use 0 for no warm-up");
  if (!(min_factor >= 0.0 && min_factor <= 1.0)) {
    fail("--min-lr must be between 0 and --lr (it is " + std::to_string(min_factor) + " x --lr)");
  }
  if (kind == Kind::Wsd && decay_steps <= 0) {
    fail("--lr-schedule wsd needs --decay-steps N > 0: the steps of its final decay");
  }
  if (kind != Kind::Wsd && decay_steps != 0) {
    fail("--decay-steps belongs to --lr-schedule wsd (the schedule is " + std::string(lr_schedule_name(kind)) + ")");
  }
  if (kind != Kind::Constant && total_steps <= 0) fail("a decaying learning-rate schedule needs the run's --steps");
  if (kind != Kind::Constant && warmup_steps >= total_steps) {
    fail("--warmup-steps " + std::to_string(warmup_steps) + " leaves nothing of --steps " + std::to_string(total_steps) +
         " to decay over: warm up for fewer steps");
  }
  if (kind == Kind::Wsd && warmup_steps + decay_steps > total_steps) {
    fail("--warmup-steps " + std::to_string(warmup_steps) + " + --decay-steps " + std::to_string(decay_steps) +
         " exceed --steps " + std::to_string(total_steps) + ": shorten the warm-up or the decay");
  }
}

double LrSchedule::factor(int64_t step) const {
  const double s = static_cast<double>(step);
  if (step <= warmup_steps) return s / static_cast<double>(warmup_steps + 1);
  if (kind == Kind::Constant) return 1.0;
  if (kind == Kind::Wsd) {
    const int64_t stable_until = total_steps - decay_steps;
    if (step <= stable_until) return 1.0;
    const double p = std::min(1.0, static_cast<double>(step - stable_until) / static_cast<double>(decay_steps));
    return 1.0 - (1.0 - min_factor) * p;
  }
  const int64_t span = total_steps - warmup_steps - 1;
  const double p = span <= 0 ? 1.0 : std::clamp(static_cast<double>(step - warmup_steps - 1) / span, 0.0, 1.0);
  if (kind == Kind::Linear) return 1.0 - (1.0 - min_factor) * p;
  return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + std::cos(M_PI * p));
}

std::string LrSchedule::describe() const {
  std::ostringstream out;
  out << lr_schedule_name(kind);
  if (warmup_steps > 0) out << ", warm-up " << warmup_steps;
  if (kind == Kind::Wsd) out << ", decay over the last " << decay_steps;
  if (kind != Kind::Constant) out << " to " << min_factor << " x lr at step " << total_steps;
  return out.str();
}

LrSchedule::Kind parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrSchedule::Kind::Constant;
  if (name == "cosine") return LrSchedule::Kind::Cosine;
  if (name == "linear") return LrSchedule::Kind::Linear;
  if (name == "wsd") return LrSchedule::Kind::Wsd;
  throw std::invalid_argument("--lr-schedule " + name + ": expected constant, cosine, linear or wsd");
}

const char* lr_schedule_name(LrSchedule::Kind kind) {
  switch (kind) {
    case LrSchedule::Kind::Constant: return "constant";
    case LrSchedule::Kind::Cosine: return "cosine";
    case LrSchedule::Kind::Linear: return "linear";
    case LrSchedule::Kind::Wsd: return "wsd";
  }
  return "?";
}

LrScheduler::LrScheduler(torch::optim::Optimizer& optimizer, LrSchedule schedule)
    : optimizer_(&optimizer), schedule_(schedule) {
  schedule_.validate();
  for (auto& g : optimizer.param_groups()) base_.push_back(g.options().get_lr());
}

void LrScheduler::apply(int64_t step) {
  const double f = schedule_.factor(step);
  auto& groups = optimizer_->param_groups();
  for (size_t i = 0; i < groups.size() && i < base_.size(); ++i) groups[i].options().set_lr(base_[i] * f);
}

void LrScheduler::restore_base() {
  auto& groups = optimizer_->param_groups();
  for (size_t i = 0; i < groups.size() && i < base_.size(); ++i) groups[i].options().set_lr(base_[i]);
}

void LrScheduler::set_base(const std::vector<double>& lrs) { base_ = lrs; }

}  // namespace dtrain::optim
