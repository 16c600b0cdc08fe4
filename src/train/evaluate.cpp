// Evaluation on held-out samples in the library loop (train/run.h).
//
// Design note [evaluation]
// ------------------------
// What is evaluated: the first E whole global batches of the held-out samples, in order (E =
// --eval-batches, or as many as there are), the same samples at every evaluation and under every
// plan. Who computes what: held-out sample i goes to data-parallel rank i mod D, in the plan's
// micro-batches, as the training deals a step's samples (Design note [the global batch]: where D
// divides the global batch every rank takes whole micro-batches of the training's shape, which a
// pipeline needs, its transfers keeping the shape agreed at the first step; uneven shares under
// --elastic run the same number of forwards on every rank, an empty micro-batch's sample again
// with weight 0). Each micro-batch's mean loss counts as many times as it has samples; the ranks of a
// tensor group or pipeline compute one replica's loss together, so one of them (tensor rank 0 of
// pipeline rank 0) adds it in; one all-reduce of (sum, count) gives every rank the mean over all E
// x G samples, one process's figure up to the order of the additions. How: the model in eval mode
// (dropout off), under no_grad (DDP, ZeRO-2 and FSDP see no backward coming: FSDP reshards each
// unit after its forward), under the training's autocast, through the pipeline's forwards alone
// (Pipeline::evaluate). Nothing of the training moves: the default random generator's state is put
// back, the sampler and the step are not touched, no gradient is written.
#include <algorithm>
#include <cstdio>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/train/plan.h"
#include "dtrain/train/planner.h"  // (RandomStateGuard)
#include "dtrain/train/run.h"

namespace dtrain::train::detail {

void Run::set_validation(int64_t samples, EvalBatch batch, std::function<void(bool)> set_train, ForwardLoss forward_loss) {
  val_samples_ = samples;
  val_batch_ = std::move(batch);
  set_train_ = std::move(set_train);
  eval_loss_ = std::move(forward_loss);
  TORCH_CHECK(val_samples_ >= plan_.batch.global, "rank ", session_.pg.rank(), ": the held-out samples (", val_samples_,
              ") are fewer than one global batch (", plan_.batch.global,
              "): evaluation takes whole global batches; hold out more (--val-fraction, --val-data) or lower the batch");
}

bool Run::eval_due(int64_t step) const {
  return val_batch_ && cfg_.eval_every > 0 && (step % cfg_.eval_every == 0 || step == cfg_.steps);
}

int64_t Run::eval_samples() const {
  int64_t batches = val_samples_ / plan_.batch.global;
  if (cfg_.eval_batches > 0) batches = std::min(batches, cfg_.eval_batches);
  return batches * plan_.batch.global;
}

double Run::evaluate() {
  TORCH_CHECK(val_batch_, "evaluate(): the run has no held-out samples (Run::set_validation)");
  const comm::ProcessGroup& pg = session_.pg;
  const int rank = pg.rank(), D = plan_.data_parallel();
  const int64_t n = eval_samples(), G = plan_.batch.global;
  const int r = plan_.layout.data_parallel_rank(rank);
  // The held-out samples dealt as the training's steps deal theirs (Design note [the global batch],
  // train/plan.h): per global batch, each rank's positions r, r + D, ... in the plan's micro-batches
  // (even: n / D samples in whole micro-batches; uneven: every rank runs the same forwards, an empty
  // micro-batch its first sample again, not counted).
  double sum = 0, count = 0;
  {
    RandomStateGuard random(session_.device);  // (the planner's: CPU and device generators)
    set_train_(false);
    at::NoGradGuard no_grad;
    std::optional<amp::AutocastGuard> autocast;
    if (plan_.precision != parallel::Precision::FP32) autocast.emplace(session_.device.type(), compute_dtype(plan_));
    for (int64_t first = 0; first < n; first += G) {
      for (int64_t m = 0; m < plan_.batch.accumulation; ++m) {
        const MicroBatchShare share = micro_batch_share(plan_.batch, D, r, m);
        auto [x, y] = val_batch_(share.positions(first, r, D));
        const double loss = strategy_->pipeline() ? strategy_->pipeline()->evaluate(x, y) : eval_loss_(x, y).item<double>();
        sum += share.end > share.begin ? loss * static_cast<double>(share.end - share.begin) : 0.0;
        count += static_cast<double>(share.end - share.begin);
      }
    }
    set_train_(true);
  }
  const bool counts = plan_.layout.tensor_rank(rank) == 0 && plan_.layout.pipeline_rank(rank) == 0;
  auto t = at::tensor(std::vector<double>{counts ? sum : 0.0, counts ? count : 0.0}, at::kDouble)
               .to(pg.device());
  comm::all_reduce(pg, t);
  t = t.to(at::kCPU);
  last_val_loss_ = t[0].item<double>() / t[1].item<double>();
  return *last_val_loss_;
}

FitResult Run::evaluate_only() {
  const double loss = evaluate();
  if (session_.pg.rank() == 0) {
    std::printf("%s: validation loss %.6g over %lld held-out samples at step %lld\n", cfg_.program.c_str(), loss,
                static_cast<long long>(eval_samples()), static_cast<long long>(start_));
    std::fflush(stdout);
  }
  return finish();
}

}  // namespace dtrain::train::detail
