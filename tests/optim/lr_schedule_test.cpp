// Learning-rate schedules (optim/lr_schedule.h): each kind's factor at the points that define it
// (warm-up from s/(W+1) to 1, cosine's midpoint, every decay ending at --min-lr on the last step,
// WSD stable then linear), written here independently of the library's code; the scheduler sets
// each parameter group from its own base; bad schedules are errors naming the flag.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include "dtrain/optim/lr_schedule.h"

using dtrain::optim::LrSchedule;
using dtrain::optim::LrScheduler;

namespace {

LrSchedule schedule(LrSchedule::Kind kind, int64_t warmup, int64_t total, double min_factor, int64_t decay = 0) {
  LrSchedule s;
  s.kind = kind;
  s.warmup_steps = warmup;
  s.total_steps = total;
  s.min_factor = min_factor;
  s.decay_steps = decay;
  s.validate();
  return s;
}

std::string error_of(const LrSchedule& s) {
  try {
    s.validate();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(LrSchedule, WarmUpRisesLinearlyThenConstantHolds) {
  const LrSchedule s = schedule(LrSchedule::Kind::Constant, 4, 0, 0);
  for (int64_t step = 1; step <= 4; ++step) EXPECT_DOUBLE_EQ(s.factor(step), step / 5.0) << step;
  for (int64_t step = 5; step <= 50; ++step) EXPECT_EQ(s.factor(step), 1.0) << step;
  const LrSchedule none = schedule(LrSchedule::Kind::Constant, 0, 0, 0);
  EXPECT_EQ(none.factor(1), 1.0);  // (no warm-up: the first step at the full rate, bit-exact)
}

TEST(LrSchedule, CosineAndLinearDecayFromTheFirstStepAfterWarmUpToTheMinimumAtTheLast) {
  const double m = 0.1;
  const LrSchedule cosine = schedule(LrSchedule::Kind::Cosine, 10, 111, m);  // decay over steps 11..111
  EXPECT_DOUBLE_EQ(cosine.factor(10), 10.0 / 11.0);
  EXPECT_DOUBLE_EQ(cosine.factor(11), 1.0);
  EXPECT_NEAR(cosine.factor(61), (1 + m) / 2, 1e-15);   // halfway: cos(pi/2) = 0
  EXPECT_NEAR(cosine.factor(36), m + (1 - m) * 0.5 * (1 + std::cos(M_PI / 4)), 1e-15);
  EXPECT_DOUBLE_EQ(cosine.factor(111), m);
  EXPECT_DOUBLE_EQ(cosine.factor(200), m);  // (past the end: the minimum)
  for (int64_t step = 12; step <= 111; ++step) EXPECT_LT(cosine.factor(step), cosine.factor(step - 1)) << step;

  const LrSchedule linear = schedule(LrSchedule::Kind::Linear, 0, 101, 0.0);
  EXPECT_DOUBLE_EQ(linear.factor(1), 1.0);
  EXPECT_DOUBLE_EQ(linear.factor(51), 0.5);
  EXPECT_DOUBLE_EQ(linear.factor(101), 0.0);
}

TEST(LrSchedule, WsdIsStableThenDecaysOverItsLastSteps) {
  const LrSchedule s = schedule(LrSchedule::Kind::Wsd, 5, 100, 0.2, 20);
  EXPECT_DOUBLE_EQ(s.factor(5), 5.0 / 6.0);
  for (int64_t step = 6; step <= 80; ++step) EXPECT_EQ(s.factor(step), 1.0) << step;
  EXPECT_DOUBLE_EQ(s.factor(81), 1.0 - 0.8 / 20);
  EXPECT_DOUBLE_EQ(s.factor(90), 1.0 - 0.8 * 10 / 20);
  EXPECT_DOUBLE_EQ(s.factor(100), 0.2);
  EXPECT_EQ(s.describe(), "wsd, warm-up 5, decay over the last 20 to 0.2 x lr at step 100");
}

TEST(LrSchedule, SchedulesThatCannotBeFollowedNameTheFlag) {
  LrSchedule s;
  s.kind = LrSchedule::Kind::Wsd;
  s.total_steps = 10;
  EXPECT_NE(error_of(s).find("--lr-schedule wsd needs --decay-steps"), std::string::npos) << error_of(s);
  s.decay_steps = 8;
  s.warmup_steps = 3;
  EXPECT_NE(error_of(s).find("--warmup-steps 3 + --decay-steps 8 exceed --steps 10"), std::string::npos) << error_of(s);
  s.kind = LrSchedule::Kind::Cosine;
  EXPECT_NE(error_of(s).find("--decay-steps belongs to --lr-schedule wsd"), std::string::npos) << error_of(s);
  s.decay_steps = 0;
  s.warmup_steps = 10;
  EXPECT_NE(error_of(s).find("leaves nothing of --steps 10"), std::string::npos) << error_of(s);
  s.warmup_steps = -1;
  EXPECT_NE(error_of(s).find("--warmup-steps -1 is negative"), std::string::npos) << error_of(s);
  EXPECT_THROW(dtrain::optim::parse_lr_schedule("cosin"), std::invalid_argument);
  EXPECT_EQ(dtrain::optim::parse_lr_schedule("wsd"), LrSchedule::Kind::Wsd);
}

TEST(LrScheduler, EachGroupFollowsTheScheduleFromItsOwnBase) {
  torch::nn::Linear a(2, 2), b(2, 2);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(a->parameters(), std::make_unique<torch::optim::AdamWOptions>(1e-3));
  groups.emplace_back(b->parameters(), std::make_unique<torch::optim::AdamWOptions>(4e-3));
  torch::optim::AdamW opt(std::move(groups), torch::optim::AdamWOptions(1e-3));
  LrScheduler sched(opt, schedule(LrSchedule::Kind::Linear, 1, 5, 0.5));
  sched.apply(1);
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 1e-3 * 0.5);
  EXPECT_DOUBLE_EQ(opt.param_groups()[1].options().get_lr(), 4e-3 * 0.5);
  sched.apply(5);
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 1e-3 * 0.5);
  sched.apply(2);  // (a function of the step: any order)
  EXPECT_DOUBLE_EQ(opt.param_groups()[1].options().get_lr(), 4e-3);
  sched.apply(4);
  sched.restore_base();
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 1e-3);
  EXPECT_EQ(opt.param_groups()[1].options().get_lr(), 4e-3);
}
