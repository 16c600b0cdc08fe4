#include "dtrain/train/loss_scaling.h"

#include <cstdio>
#include <limits>
#include <optional>
#include <vector>

#include <c10/util/Exception.h>

#include "dtrain/util/parse.h"

namespace dtrain::train {


namespace {

// The DTRAIN_TEST_INF_GRAD_AT_STEP hook (loss_scaling.h): +inf into the first gradient element the
// chosen rank holds, after step `step`'s backward.
void maybe_inject_inf_for_test(const std::string& program, int64_t step, int rank, int world,
                               const std::vector<at::Tensor>& held) {
  static const std::optional<int64_t> at_step = util::env_int("DTRAIN_TEST_INF_GRAD_AT_STEP");
  static const int64_t steps = util::env_int("DTRAIN_TEST_INF_GRAD_STEPS").value_or(1);
  if (!at_step || step < *at_step || step >= *at_step + steps) return;
  if (util::env_int("DTRAIN_TEST_INF_GRAD_RANK").value_or(world - 1) != rank) return;
  for (const auto& p : held) {
    if (!p.grad().defined() || p.grad().numel() == 0) continue;
    at::NoGradGuard no_grad;
    p.grad().view({-1}).narrow(0, 0, 1).fill_(std::numeric_limits<double>::infinity());
    std::fprintf(stderr, "%s [rank %d]: DTRAIN_TEST_INF_GRAD_AT_STEP=%lld: +inf written into a gradient (test hook)\n",
                 program.c_str(), rank, static_cast<long long>(step));
    std::fflush(stderr);
    return;
  }
  TORCH_CHECK(false, "rank ", rank, ": DTRAIN_TEST_INF_GRAD_AT_STEP: this rank holds no gradient to write +inf into; "
              "pick another DTRAIN_TEST_INF_GRAD_RANK");
}

}  // namespace

LossScaling::LossScaling(const TrainConfig& o, bool enabled, const comm::ProcessGroup& pg)
    : program_(o.program),
      enabled_(enabled),
      rank_(pg.rank()),
      world_(pg.size()),
      scaler_(amp::GradScalerOptions().growth_interval(o.loss_scale_growth_interval).enabled(enabled_), pg),
      max_skipped_in_a_row_(o.max_skipped_steps) {
  TORCH_CHECK(enabled_ || !util::env_int("DTRAIN_TEST_INF_GRAD_AT_STEP"),
              "DTRAIN_TEST_INF_GRAD_AT_STEP (a test hook) needs --loss-scale dynamic");
}

bool LossScaling::unscale(Strategy& strategy, int64_t step) {
  if (!enabled_) return true;
  const std::vector<at::Tensor> held = strategy.grads_held();
  maybe_inject_inf_for_test(program_, step, rank_, world_, held);
  scaler_.unscale(held);
  return !scaler_.found_inf();
}

bool LossScaling::step(Strategy& strategy, int64_t step) {
  if (!enabled_) {
    strategy.step();
    return true;
  }
  const double before = scaler_.get_scale();
  const bool stepped = scaler_.step([&] { strategy.step(); }, {});
  scaler_.update();
  if (!stepped) {
    ++skipped_;
    if (rank_ == 0) {
      std::printf("%s: step %lld: inf/NaN in the gradients: skipped on every rank, loss scale %g -> %g "
                  "(%lld step(s) skipped so far)\n", program_.c_str(),
                  static_cast<long long>(step), before, scaler_.get_scale(), static_cast<long long>(skipped_));
      std::fflush(stdout);
    }
    ++skipped_in_a_row_;
    TORCH_CHECK(max_skipped_in_a_row_ == 0 || skipped_in_a_row_ < max_skipped_in_a_row_, "step ",
                step, ": the last ", skipped_in_a_row_, " steps were all skipped for inf/NaN gradients (loss scale now ",
                scaler_.get_scale(), "): the run diverged; stopping (lower --lr, clip with --clip-grad-norm, or raise "
                "--max-skipped-steps)");
  } else {
    skipped_in_a_row_ = 0;
  }
  return stepped;
}

void LossScaling::save(checkpoint::Metadata& meta) const {
  if (!enabled_) return;
  checkpoint::put_grad_scaler_state(meta, scaler_.state());
  checkpoint::put(meta, "train/skipped_steps", skipped_);
}

void LossScaling::load(const checkpoint::Metadata& meta) {
  if (!enabled_) return;
  if (meta.count("amp/scale") == 0) {
    if (rank_ == 0) {
      std::printf("%s: the checkpoint has no loss-scaler state (saved with --loss-scale none): starting "
                  "from scale %g\n", program_.c_str(), scaler_.get_scale());
      std::fflush(stdout);
    }
    return;
  }
  scaler_.load_state(checkpoint::grad_scaler_state(meta));
  skipped_ = meta.count("train/skipped_steps") ? checkpoint::get_int(meta, "train/skipped_steps") : 0;
}

}  // namespace dtrain::train
