#pragma once
// Loss scaling in the library loop (--loss-scale none|dynamic, --loss-scale-growth-interval): an
// amp::GradScaler over the world group in its sharded form (each rank unscales and checks the
// gradients it holds, Strategy::grads_held; the inf/NaN finding is agreed, so every rank skips
// together), its state in the checkpoints, and the skipped steps counted for the metrics.
//
// Design note [loss scaling in the loop]: one optimizer step is
//   for each micro-batch: backward of scale(loss)   (gradients S times too large)
//   unscale(grads_held)      divide by S; inf/NaN anywhere on any rank -> every rank skips
//   clip                     only when finite, on the true gradients (the norm is S-free)
//   optimizer step           unless skipped
//   update                   skipped: S halves; growth_interval good steps in a row: S doubles
// The scale is a power of two, and multiplying by 2^k commutes with fp32 and bf16 rounding (barring
// overflow and subnormals), so with fp32 or bf16 a dynamic scale trains like no scale: the CPU
// tests run this whole path that way. fp16 (CUDA) defaults to it.
//
// Checkpoint keys: amp/scale and amp/growth_tracker (checkpoint::put_grad_scaler_state), and the
// count of skipped steps as train/skipped_steps. A checkpoint without them (saved with
// --loss-scale none) resumes a dynamic run from the initial scale; a run without loss scaling
// ignores them.
//
// Test hook: DTRAIN_TEST_INF_GRAD_AT_STEP=N (and the DTRAIN_TEST_INF_GRAD_STEPS - 1 steps after it)
// writes +inf into the first gradient element that one
// rank (DTRAIN_TEST_INF_GRAD_RANK, default the last) holds, after step N's backward: every rank
// must skip step N and halve the scale. Needs --loss-scale dynamic.
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/train/config.h"
#include "dtrain/train/strategy.h"

namespace dtrain::train {

class LossScaling {
 public:
  // `enabled`: the plan's loss scaling (otherwise every call is a pass-through); o: the growth
  // interval and the skipped steps allowed.
  LossScaling(const TrainConfig& o, bool enabled, const dtrain::comm::ProcessGroup& pg);

  bool enabled() const { return enabled_; }
  // The loss to call backward on (the loss times the scale).
  at::Tensor scale(const at::Tensor& loss) const { return scaler_.scale(loss); }
  // The scale this step's backward uses.
  double current_scale() const { return scaler_.get_scale(); }
  // After the step's last backward (`step` 1-based): unscales the gradients this rank holds and
  // returns whether every rank's are finite. Collective when enabled; true when disabled.
  bool unscale(Strategy& strategy, int64_t step);
  // Runs the optimizer step unless unscale() found inf/NaN, then updates the scale. Returns whether
  // it stepped; rank 0 prints a line for a skipped step. Throws (on every rank alike) when
  // --max-skipped-steps steps in a row were skipped: the run diverged, halving the scale does not help.
  bool step(Strategy& strategy, int64_t step);
  int64_t skipped_steps() const { return skipped_; }
  // After an elastic recovery: the new group (its agreement on inf/NaN, who prints); the state goes
  // on as it was (replicated: every survivor holds it), or load() puts a snapshot's back.
  void regroup(const dtrain::comm::ProcessGroup& pg) {
    rank_ = pg.rank();
    world_ = pg.size();
    scaler_.regroup(pg);
  }

  // Checkpoints: the scaler's state and the skipped-step count into `meta` (nothing when disabled),
  // and back. load() prints on rank 0 when the checkpoint has no scaler state.
  void save(dtrain::checkpoint::Metadata& meta) const;
  void load(const dtrain::checkpoint::Metadata& meta);

 private:
  std::string program_;
  bool enabled_;
  int rank_, world_;
  dtrain::amp::GradScaler scaler_;
  int64_t skipped_ = 0;
  int64_t skipped_in_a_row_ = 0;
  int64_t max_skipped_in_a_row_ = 0;  // 0: never stop
};

}  // namespace dtrain::train
