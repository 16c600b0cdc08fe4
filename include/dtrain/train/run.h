#pragma once
// One training run of the library loop (train/fit.h) besides the model's forward: the data order,
// loss scaling, checkpoints, the metrics and progress line, the summary. train::fit's loop is a
// template only for the dataset's batches and the model's forward; everything else is here.
//
// Data order: the epoch's permutation of the dataset (DistributedSampler's, shuffle and seed);
// step t covers its positions [t*G, (t+1)*G) (G the global batch), dealt round-robin over the
// data-parallel ranks and cut into micro-batches (Design note [the global batch], train/plan.h),
// and an epoch has floor(N / G) steps: every plan and world size trains the same samples at every
// step (where D divides G, each rank reads what DistributedSampler over D ranks gives it).
//
// One step (Design note [loss scaling in the loop], loss_scaling.h): the step's learning rate
// (optim/lr_schedule.h); zero_grad; for each
// micro-batch (all but the last under no_sync) forward under autocast, backward of the scaled
// loss; unscale the gradients this rank holds; clip (when finite); step unless a rank found
// inf/NaN; one small all_gather of every rank's loss and peak RSS for the report.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/comm/traffic.h"
#include "dtrain/data/distributed_sampler.h"
#include "dtrain/optim/lr_schedule.h"
#include "dtrain/parallel/plan.h"
#include "dtrain/train/checkpointing.h"
#include "dtrain/train/config.h"
#include "dtrain/train/elastic.h"
#include "dtrain/train/loss_scaling.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/progress.h"
#include "dtrain/train/session.h"
#include "dtrain/train/strategy.h"
#include "dtrain/train/tensorboard.h"
#include "dtrain/util/step_profile.h"

namespace dtrain::train {

struct FitOptions {
  // tokens_per_s counts samples x tokens_per_sample (a sequence of T tokens: T; else 1).
  int64_t tokens_per_sample = 1;
  // Training FLOPs per token, for the mfu metric (0: no mfu).
  double flops_per_token = 0;
  // Printed by rank 0 after the plan's line (e.g. "GPT 4 layers, d_model 128 (0.85M parameters)").
  std::string model_description;
};

struct FitResult {
  int64_t start_step = 0;    // the step a resumed run went on from
  std::optional<double> val_loss;  // the last evaluation's (--eval-every, --eval-only)
  double tokens_per_s = 0;   // over this run's steps
  double param_checksum = 0, param_sq = 0;
};

namespace detail {

// Model FLOPs utilisation: training FLOPs per token x tokens/s over `world` devices' peak; 0 when
// either the FLOPs or the peak is unknown.
inline double mfu(double tokens_per_s, double flops_per_token, double peak_tflops, int world) {
  return flops_per_token > 0 && peak_tflops > 0 ? tokens_per_s * flops_per_token / (peak_tflops * 1e12 * world) : 0.0;
}
int64_t count_parameters(const torch::nn::Module& m);  // each distinct tensor once
// Throws naming the step when the loss or the gradient norm (-1: not computed) is not finite.
void check_finite(const TrainConfig& cfg, int64_t step, double loss, double grad_norm, bool loss_scaling);

// A micro-batch's mean loss through the model's forward (the loop's template part).
using ForwardLoss = std::function<at::Tensor(const at::Tensor& inputs, const at::Tensor& targets)>;

class Run {
 public:
  // Prints the run's first lines (rank 0), resumes from cfg.resume, opens the metrics. `predicted`:
  // the memory plan's peak for this plan (-1: not planned), for the final record.
  Run(Session& session, const TrainConfig& cfg, Strategy& strategy, int64_t samples, const FitOptions& fo,
      int64_t parameters, int64_t predicted);
  ~Run();
  int64_t start() const { return start_; }
  // Before step `step` (0-based): the test hooks, the epoch's order, zero_grad.
  void begin_step(int64_t step);
  // The dataset indices of this rank's micro-batch m of the step begun.
  std::vector<int64_t> micro_batch(int64_t m) const;
  // Micro-batch m of the step: forward and backward (a pipeline's whole step), under autocast.
  void micro_step(int64_t m, const at::Tensor& x, const at::Tensor& y, const ForwardLoss& forward_loss);
  // After the micro-batches: synchronise, unscale, clip, step; evaluate when due; report; save
  // when due. With --elastic the step's report all-gather and the vote come before the optimizer
  // step (Design note [in-process recovery], train/elastic.h): a dropped step throws CommError.
  void end_step();
  // The steps done: the step begun, once its optimizer step was decided (committed with --elastic).
  int64_t committed() const { return committed_; }

  // After a recovery: goes on under `strategy` (the plan rebuilt on the session's new group) from
  // step `next` (0-based; before committed() where sharded state rolled back to a snapshot: Design
  // note [sharded state in process], recovery.h); `recovery_s`: the time since the failure, for
  // the record. Collective (the partner snapshots over the new group).
  void regroup(Strategy& strategy, int64_t next, double recovery_s);
  // As a recovery begins (a retry's keeps the first try's): what every rank sends from here to the
  // start of the next step (the state re-split, the joiners' share, the generation's first
  // snapshot) is reported with that step's record (recovery_mib, its part across nodes). A
  // joiner's counts from its start.
  void begin_recovery();
  // --save-async with --elastic, around a regroup: finish_save waits for the background save in
  // flight (growing: every member is there to complete it); abandon_save, once the old generation
  // is aborted, waits for it to end and drops the saver (a save a lost member cut is not
  // committed); regroup makes the new generation's.
  void finish_save();
  void abandon_save();
  // A roll-back to partner snapshots (Design note [sharded state in process]): the loss scaler's
  // state as the snapshots' metadata holds it (none without loss scaling).
  void restore_scaling(const std::map<std::string, std::string>& metadata) { scaling_.load(metadata); }
  // --elastic, where processes joined: rank 0's step, learning-rate base and optimizer state to
  // the joiners (collective; a joiner calls it after building its model on the
  // group, the members after regroup).
  void share_state();
  // --elastic with --snapshot-every, as a generation begins (the run's first, or after a regroup
  // and share_state): a partner snapshot of the step it starts from, complete before any step, so
  // a failure before the first periodic snapshot completes rolls back to it (Design note [sharded
  // state in process], recovery.h). Collective.
  void snapshot_generation_start();
  // --snapshot-every: the partner snapshots a recovery rolls back to (nullptr: none): this
  // generation's, or while a regroup is in progress (until the new generation's first snapshot
  // completes) the generation's before, so a failure during the recovery retries from them.
  checkpoint::PartnerSnapshots* snapshots() { return recovery_snapshots_ ? recovery_snapshots_.get() : snapshots_.get(); }

  // Evaluation (--eval-every, --eval-only; Design note [evaluation]): the held-out samples (their
  // count, and a batch of them on the device by indices in [0, samples)), the model's mode switch
  // (train(false) for evaluation) and the micro-batch's mean loss.
  using EvalBatch = std::function<std::pair<at::Tensor, at::Tensor>(const std::vector<int64_t>& indices)>;
  void set_validation(int64_t samples, EvalBatch batch, std::function<void(bool)> set_train, ForwardLoss forward_loss);
  // The mean loss over the evaluated held-out samples, as one process computes it; every rank
  // returns it (collective). Leaves the training state as it was.
  double evaluate();
  // --eval-only: evaluates the resumed checkpoint and reports it (the metrics' final record too).
  FitResult evaluate_only();
  // After the last step: export, the summary line and the final record (collective).
  FitResult finish();

 private:
  struct StepReport {
    double loss, rss, grad_norm;  // grad_norm -1: not computed
    bool stepped;
    double loss_scale, dt, optimizer_s, pipeline_idle;  // pipeline_idle -1: no pipeline
    std::optional<double> val_loss;                     // (evaluated after this step)
    double lr = 0;                                      // the step's learning rate
    double checkpoint_stall_s = -1, checkpoint_mib = -1, checkpoint_write_s = -1;  // -1: no save
    double snapshot_s = -1;                                                       // -1: no snapshot
    double copy_wait_s = -1;  // what the optimizer step waited for a background copy (-1: none pending)
    double checkpoint_copy_s = -1;  // a finished background save's copy of the steady pieces
    double checkpoint_write_cpu_s = -1;  // the CPU time of a finished background save's thread
    double across_nodes_mib = 0;  // what all ranks sent to another node this step (comm/traffic.h)
    double recovery_mib = -1, recovery_across_mib = -1;  // what all ranks sent in the recovery before it (-1: none)
  };
  bool eval_due(int64_t step) const;  // step counts from 1
  int64_t eval_samples() const;       // how many held-out samples an evaluation takes
  void report(const StepReport& r);  // rank 0: progress, metrics, TensorBoard
  void share_scaling();              // share_state: rank 0's loss-scaler state to the joiners
  // The step's report all-gather: [world, 8] of every rank's loss, peak RSS, pipeline compute and
  // wall time, whether its background save failed, the MiB it sent to another node so far, and
  // the MiB it sent in the recovery before the step (all of it, across nodes; 0: none).
  at::Tensor gather_report();
  double wait_for_copies();          // the fence before the optimizer step; seconds waited

  Session& session_;
  const TrainConfig& cfg_;
  Strategy* strategy_;
  parallel::Plan plan_;  // (the strategy's; replaced by regroup)
  FitOptions fo_;
  int64_t parameters_, predicted_;
  optim::LrScheduler lr_;  // (each group's base: its lr when the run begins, Design note [a schedule is a function of the step])
  data::DistributedSampler sampler_;
  DataPlan data_;
  LossScaling scaling_;
  int64_t start_ = 0;
  MetricsWriter metrics_;
  TensorBoardWriter tensorboard_;
  Progress progress_;
  double peak_tflops_ = 0, tokens_per_step_ = 0, total_time_ = 0;
  // The step in flight.
  int64_t step_ = 0, epoch_ = -1, committed_ = 0;
  comm::Traffic traffic0_;  // (at the step's start)
  struct Sent {
    int64_t all = 0, across_nodes = 0;  // (ring_bytes_sent, across_nodes_sent)
  };
  std::optional<Sent> recovery0_;  // (at a recovery's start: begin_recovery)
  util::StepProfile profile_;  // DTRAIN_PROFILE (a developer's kernel profile of a few steps)
  std::optional<StepReport> last_report_;  // --elastic: the last committed step's
  std::vector<int64_t> order_;
  std::chrono::steady_clock::time_point t0_;
  double local_loss_ = 0, fwd_s_ = 0, bwd_s_ = 0, pipe_compute_s_ = 0, pipe_wall_s_ = 0;
  // The step's summed micro-batch losses where they were computed (a GPU's: read once the optimizer
  // step is queued, so the step's one synchronisation comes after it, not between backward and it).
  at::Tensor loss_sum_;
  std::unique_ptr<checkpoint::AsyncSaver> saver_;  // --save-async
  bool reserved_ = false;  // the saver's host buffers reserved (after the first step)
  // A background copy of the steady state is pending: the next optimizer step waits for it (Design
  // note [a copy overlapped with the next step], checkpoint/async_saver.h).
  bool copy_pending_ = false;
  std::unique_ptr<checkpoint::PartnerSnapshots> snapshots_;  // --snapshot-every
  std::unique_ptr<checkpoint::PartnerSnapshots> recovery_snapshots_;  // (snapshots(): a regroup's, until it completes)
  void make_snapshots();  // (collective: over the session's group)
  double end_snapshot_in_step();  // --snapshot-sync: the step's snapshot everywhere before its record; seconds
  void agree_snapshots_everywhere();  // this rank's exchange ended, then an all-reduce: every rank's did (collective)
  // Drops snapshots of an old generation; their Gloo group goes to the Elastic's retired groups
  // (never destroyed on the training thread: Design note [aborting a group's waits]).
  void retire(std::unique_ptr<checkpoint::PartnerSnapshots> old);
  int64_t redone_until_ = 0;  // --elastic: steps up to this one are redone after a roll-back (recorded again)
  // Evaluation.
  int64_t val_samples_ = 0;
  EvalBatch val_batch_;
  std::function<void(bool)> set_train_;
  ForwardLoss eval_loss_;
  std::optional<double> last_val_loss_;
};

}  // namespace detail
}  // namespace dtrain::train
