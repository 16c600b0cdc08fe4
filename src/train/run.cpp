// The library loop's run (train/run.h): data order, one step's synchronisation and report.
#include "dtrain/train/run.h"

#include <algorithm>
#include <cctype>
#include <optional>

#include <ATen/ATen.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/flight_recorder.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/train/plan.h"
#include "dtrain/train/recovery.h"
#include "dtrain/util/memory.h"
#include "dtrain/util/system.h"

namespace dtrain::train::detail {

void print_start(const TrainConfig& cfg, const Session& s, const parallel::Plan& plan, const FitOptions& fo,
                 int64_t parameters, int64_t steps_per_epoch, int64_t samples);

namespace {

// What rank 0 sent this step by ring algorithms (comm/traffic.h), the report's all-gather
// included, in all and per group (by its label); and what all ranks sent to another node until the
// report (`across_mib`: the load on the links between nodes).
void add_traffic(JsonLine& line, const comm::Traffic& before, const comm::Traffic& now, double across_mib) {
  auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / 1048576.0; };
  line.add("comm_mib_sent", mib(now.ring_bytes_sent - before.ring_bytes_sent));
  line.add("comm_mib_across_nodes", across_mib);
  for (const auto& [label, g] : now.by_group) {
    const auto was = before.by_group.find(label);
    const int64_t sent = g.sent - (was == before.by_group.end() ? 0 : was->second.sent);
    if (sent <= 0) continue;
    std::string key = "comm_mib_sent_" + label;  // ("world/0.1" -> "world_0_1")
    for (char& c : key) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
    }
    line.add(key, mib(sent));
  }
}

// The epoch's order of the whole dataset (DistributedSampler's permutation; each step deals its
// global batch's positions over the data-parallel ranks: micro_batch).
data::DistributedSampler epoch_order(int64_t samples, uint64_t seed) {
  return data::DistributedSampler(samples, data::DistributedSamplerOptions(1, 0).shuffle(true).seed(static_cast<int64_t>(seed)).drop_last(true));
}
}  // namespace

Run::Run(Session& session, const TrainConfig& cfg, Strategy& strategy, int64_t samples, const FitOptions& fo,
         int64_t parameters, int64_t predicted)
    : session_(session), cfg_(cfg), strategy_(&strategy), plan_(strategy.plan()), fo_(fo), parameters_(parameters),
      predicted_(predicted), lr_(strategy.optimizer(), cfg.lr_schedule_of()), sampler_(epoch_order(samples, cfg.seed)),
      scaling_(cfg, plan_.loss_scaling, session.pg), progress_(cfg.steps, Progress::stdout_is_interactive()),
      profile_(util::StepProfile::from_environment(session.pg.rank())) {
  data_ = DataPlan{samples, plan_.batch.global, samples / plan_.batch.global};  // (Design note [the global batch])
  TORCH_CHECK(data_.steps_per_epoch >= 1, "the data (", samples, " samples) is too small for a global batch of ",
              plan_.batch.global, " samples: lower --batch-size/--global-batch-size or give more data");
  const int rank = session.pg.rank();
  if (rank == 0) print_start(cfg, session, plan_, fo, parameters, data_.steps_per_epoch, samples);
  // --resume: the model, optimizer and random state of the checkpoint, and the step to go on from.
  // (a process joining an elastic run takes the step and state from the live ranks: share_state)
  const bool joining = session.elastic && session.elastic->newcomer();
  if (!joining) start_ = resume_checkpoint(cfg, session.pg, strategy, scaling_, data_);
  if (joining) recovery0_ = Sent{};  // (its part of the recovery: since it started)
  committed_ = start_;
  if (rank == 0 && !cfg.metrics.empty()) {
    metrics_ = MetricsWriter(cfg.metrics);
    metrics_.write(JsonLine().add("start", true).add("plan", plan_.name()).add("plan_line", plan_.describe())
                       .add("world_size", static_cast<int64_t>(session.pg.size())).add("global_batch", plan_.batch.global)
                       .add("micro_batch", plan_.batch.micro).add("accumulation", plan_.batch.accumulation)
                       .add("allocator", util::allocator_in_use()).add("config", to_toml(cfg)));
  }
  if (rank == 0 && !cfg.tensorboard.empty()) tensorboard_ = TensorBoardWriter(cfg.tensorboard);
  peak_tflops_ = cfg.peak_tflops > 0 ? cfg.peak_tflops : util::known_peak_tflops(util::device_name(session.device));
  tokens_per_step_ = static_cast<double>(plan_.batch.global * fo.tokens_per_sample);
  util::reset_peak_bytes(session.device);  // (the steps' peak, for the final record)
  if (cfg.save_async && !cfg.save.empty() && !cfg.eval_only) saver_ = std::make_unique<checkpoint::AsyncSaver>(session.pg);
  if (cfg.snapshot_every > 0 && !cfg.eval_only) make_snapshots();
}

void Run::snapshot_generation_start() {
  if (!snapshots_ || !session_.elastic) return;
  lr_.restore_base();  // (as a checkpoint: the run's learning rate)
  take_partner_snapshot(cfg_, session_.pg, *strategy_, scaling_, data_, committed_, *snapshots_);
  // (every rank's exchange ended before any drops the snapshots a retry would roll back to: a rank
  // lost during it leaves every survivor holding the old ones)
  agree_snapshots_everywhere();
  snapshots_->yield_cores();  // (waited on until now: Design note [background groups yield once ready])
  if (recovery_snapshots_) retire(std::move(recovery_snapshots_));  // (the regroup is complete)
}

void Run::make_snapshots() {  // the partner on another node where the job spans nodes, in another unit where there are units
  const comm::ProcessGroup& pg = session_.pg;
  const int stride = snapshot_stride(plan_, pg.size(), session_.launch.local_world_size);
  if (snapshots_ && !recovery_snapshots_) {
    recovery_snapshots_ = std::move(snapshots_);  // (kept until the new generation's first snapshot)
  } else if (snapshots_) {
    retire(std::move(snapshots_));  // (a failed attempt's)
  }
  snapshots_ = std::make_unique<checkpoint::PartnerSnapshots>(pg, stride);
  // (--elastic: a generation's first snapshot is waited on; it yields after that one)
  if (!session_.elastic) snapshots_->yield_cores();
}

void Run::finish_save() {
  if (saver_) saver_->wait();
}

void Run::abandon_save() {
  if (!saver_) return;
  comm::ProcessGroup group = saver_->abandon();
  if (session_.elastic) session_.elastic->retire(group);
  saver_.reset();
}

void Run::retire(std::unique_ptr<checkpoint::PartnerSnapshots> old) {
  if (session_.elastic) session_.elastic->retire(old->group());
  old.reset();  // (waits for its exchange: ended, or aborted with its generation)
}

Run::~Run() = default;

void Run::begin_step(int64_t step) {
  step_ = step;
  maybe_fail_for_test(cfg_.program, step + 1, session_.pg.rank(), session_.pg.size());
  profile_.begin_step(step + 1);
  t0_ = std::chrono::steady_clock::now();
  if (step / data_.steps_per_epoch != epoch_) {
    epoch_ = step / data_.steps_per_epoch;
    sampler_.set_epoch(epoch_);
    order_ = sampler_.indices();
  }
  traffic0_ = comm::traffic();
  lr_.apply(step + 1);
  strategy_->zero_grad();
  local_loss_ = fwd_s_ = bwd_s_ = pipe_compute_s_ = pipe_wall_s_ = 0;
  loss_sum_ = at::Tensor();
}

std::vector<int64_t> Run::micro_batch(int64_t m) const {
  const int d = plan_.data_parallel(), r = plan_.layout.data_parallel_rank(session_.pg.rank());
  const MicroBatchShare share = micro_batch_share(plan_.batch, d, r, m);
  std::vector<int64_t> out = share.positions((step_ % data_.steps_per_epoch) * plan_.batch.global, r, d);
  for (int64_t& i : out) i = order_.at(i);  // (an empty share's one sample runs with weight 0: micro_step)
  return out;
}

void Run::micro_step(int64_t m, const at::Tensor& x, const at::Tensor& y, const ForwardLoss& forward_loss) {
  const double accumulation = static_cast<double>(plan_.batch.accumulation);
  std::optional<amp::AutocastGuard> autocast;  // bf16 or fp16 on the device's type (the forwards only)
  const auto f0 = std::chrono::steady_clock::now();
  if (pipeline::Pipeline* pipe = strategy_->pipeline()) {  // --pp: forwards and backwards of every pipeline micro-batch
    const double multiplier = (scaling_.enabled() ? scaling_.current_scale() : 1.0) / accumulation;
    if (plan_.precision != parallel::Precision::FP32) autocast.emplace(session_.device.type(), compute_dtype(plan_));
    local_loss_ += pipe->step(x, y, multiplier) / accumulation;
    pipe_compute_s_ += pipe->last_step_times().compute_s;
    pipe_wall_s_ += pipe->last_step_times().wall_s;
    fwd_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
    return;
  }
  auto guard = m + 1 == plan_.batch.accumulation ? nullptr : strategy_->no_sync();
  at::Tensor loss;
  if (plan_.precision != parallel::Precision::FP32) autocast.emplace(session_.device.type(), compute_dtype(plan_));
  // Each micro-batch's mean loss weighted by its samples (1 / accumulation where the ranks' shares
  // are even; Design note [the global batch]).
  const double divisor = micro_batch_share(plan_.batch, plan_.data_parallel(),
                                           plan_.layout.data_parallel_rank(session_.pg.rank()), m).divisor;
  loss = divisor > 0 ? forward_loss(x, y) / divisor : forward_loss(x, y) * 0.0;
  autocast.reset();
  const auto f1 = std::chrono::steady_clock::now();
  scaling_.scale(loss).backward();  // with ddp: ends after the last bucket's all-reduce is written back
  fwd_s_ += std::chrono::duration<double>(f1 - f0).count();
  bwd_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - f1).count();
  // (an empty micro-batch's loss is not counted: its weight is 0, and it is not added even if NaN)
  if (divisor > 0) loss_sum_ = loss_sum_.defined() ? loss_sum_ + loss.detach() : loss.detach();
}

at::Tensor Run::gather_report() {
  const comm::ProcessGroup& pg = session_.pg;
  const int world = pg.size();
  // One small collective for the step's report: every rank's loss and peak RSS (and with --pp its
  // pipeline's compute and wall time, and whether its background save failed).
  if (loss_sum_.defined()) local_loss_ += loss_sum_.item<double>();
  loss_sum_ = at::Tensor();
  const double save_failed = saver_ && saver_->failed() ? 1.0 : 0.0;
  constexpr double kMiB = 1048576.0;
  const double across_mib = static_cast<double>(comm::traffic().across_nodes_sent - traffic0_.across_nodes_sent) / kMiB;
  const Sent r0 = recovery0_.value_or(Sent{traffic0_.ring_bytes_sent, traffic0_.across_nodes_sent});  // (no recovery: none)
  auto mine = at::tensor(std::vector<double>{local_loss_, util::peak_rss_mib(), pipe_compute_s_, pipe_wall_s_, save_failed, across_mib,
                                             static_cast<double>(traffic0_.ring_bytes_sent - r0.all) / kMiB,
                                             static_cast<double>(traffic0_.across_nodes_sent - r0.across_nodes) / kMiB},
                         at::kDouble)
                  .to(pg.device());
  auto all = at::empty({8 * world}, at::TensorOptions().dtype(at::kDouble).device(pg.device()));
  comm::all_gather(pg, all, mine);
  return all.to(at::kCPU).view({world, 8});
}

void Run::end_step() {
  const comm::ProcessGroup& pg = session_.pg;
  const int world = pg.size();
  strategy_->after_backward();
  const auto o0 = std::chrono::steady_clock::now();
  const double loss_scale = scaling_.current_scale();
  const bool finite = scaling_.unscale(*strategy_, step_ + 1);
  const double grad_norm = cfg_.clip_grad_norm > 0 && finite ? strategy_->clip_grad_norm(cfg_.clip_grad_norm) : -1.0;
  at::Tensor per_rank;
  if (session_.elastic) {  // the report, then the vote: the optimizer steps on every rank or on none
    per_rank = gather_report();
    // The last partner snapshot's exchange ends before the vote: a committed step t means every rank
    // holds the snapshots of step t - 1, so a roll-back redoes at most one committed step (Design
    // note [sharded state in process], recovery.h). (It overlapped the step's forwards and backwards.)
    if (snapshots_) snapshots_->wait();
    maybe_fail_for_test(cfg_.program, step_ + 1, pg.rank(), world, "vote");
    if (!session_.elastic->commit(step_ + 1)) {
      throw comm::CommError(pg.describe() + " step " + std::to_string(step_ + 1) + " dropped: " +
                            pg.abort_signal()->reason().value_or("a rank failed"));
    }
  }
  committed_ = step_ + 1;
  // The fence: the last save's background copy of the parameters and optimizer state ends first.
  const double copy_wait = copy_pending_ ? wait_for_copies() : -1.0;
  const bool stepped = scaling_.step(*strategy_, step_ + 1);
  const double opt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - o0).count();
  if (!per_rank.defined()) per_rank = gather_report();  // (a GPU's loss read after the step is queued)
  // A failed background save fails on every rank (checkpoint::save agrees): once one rank has seen
  // it, all wait for theirs and stop at this step with its error.
  if (per_rank.select(1, 4).max().item<double>() > 0) saver_->wait();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  total_time_ += dt;
  // The loss of the step: each data-parallel rank's mean over its micro-batches, averaged (the
  // ranks of one tensor group or pipeline report the same).
  StepReport r{per_rank.select(1, 0).mean().item<double>(), per_rank.select(1, 1).max().item<double>(), grad_norm,
               stepped, loss_scale, dt, opt_s, -1, std::nullopt};
  r.copy_wait_s = copy_wait;
  r.across_nodes_mib = per_rank.select(1, 5).sum().item<double>();
  if (recovery0_) {  // (the first step after a recovery: what it moved)
    r.recovery_mib = per_rank.select(1, 6).sum().item<double>();
    r.recovery_across_mib = per_rank.select(1, 7).sum().item<double>();
    recovery0_.reset();
  }
  if (session_.elastic) last_report_ = r;  // (a new rank 0 records it if the old one could not: regroup)
  // A diverged run stops (every rank sees the same mean loss and global norm: all stop alike).
  check_finite(cfg_, step_ + 1, r.loss, grad_norm, scaling_.enabled());
  if (strategy_->pipeline()) {  // measured: 1 - sum of compute / (ranks x the slowest rank's pipeline time)
    const double wall = per_rank.select(1, 3).max().item<double>();
    if (wall > 0) r.pipeline_idle = 1.0 - per_rank.select(1, 2).sum().item<double>() / (world * wall);
  }
  if (eval_due(step_ + 1)) {
    maybe_fail_for_test(cfg_.program, step_ + 1, pg.rank(), world, "eval");
    r.val_loss = evaluate();
  }
  r.lr = strategy_->optimizer().param_groups().at(0).options().get_lr();
  if (save_due(cfg_, step_ + 1)) {
    maybe_fail_for_test(cfg_.program, step_ + 1, pg.rank(), world, "save");
    lr_.restore_base();  // (the checkpoint holds the run's learning rate; the schedule gives each step's)
    const auto s0 = std::chrono::steady_clock::now();
    if (saver_) {
      const auto saved = save_checkpoint_async(cfg_, pg, *strategy_, scaling_, data_, step_ + 1, *saver_);
      // (from before the state's snapshot, as a synchronous save's: the copy is not all it costs)
      r.checkpoint_stall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
      r.checkpoint_mib = static_cast<double>(saved.bytes) / 1048576.0;
      copy_pending_ = copy_pending_ || saved.overlapped_bytes > 0;
    } else {
      save_checkpoint(cfg_, pg, *strategy_, scaling_, data_, step_ + 1);
      r.checkpoint_stall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    }
  } else if (saver_ && !reserved_) {
    // After the first step (the optimizer's state exists): the host buffers are made while the
    // next steps run, so the first save costs a copy as later ones do.
    saver_->reserve(state_of(cfg_, pg, *strategy_, scaling_, data_, step_ + 1).pieces);
    reserved_ = true;
  }
  if (saver_) {
    if (const auto written = saver_->finished()) {
      r.checkpoint_write_s = written->write_s;
      r.checkpoint_write_cpu_s = written->write_cpu_s;
      if (written->overlapped_bytes > 0) r.checkpoint_copy_s = written->copy_s;
    }
  }
  if (snapshots_ && (step_ + 1) % cfg_.snapshot_every == 0) {
    maybe_fail_for_test(cfg_.program, step_ + 1, pg.rank(), world, "snapshot");
    lr_.restore_base();  // (as a checkpoint: the run's learning rate)
    r.snapshot_s = take_partner_snapshot(cfg_, pg, *strategy_, scaling_, data_, step_ + 1, *snapshots_);
    copy_pending_ = true;
    if (cfg_.snapshot_sync) r.snapshot_s += end_snapshot_in_step();
  }
  if (pg.rank() == 0) report(r);
  comm::flight::note_step(step_ + 1);  // (shown in dtrun's stall reports)
  profile_.end_step(step_ + 1);
}

double Run::end_snapshot_in_step() {
  // Design note [sharded state in process] (recovery.h): the exchange, then one agreement that it
  // ended everywhere (a rank past it knows every rank holds the step's snapshots, since every rank
  // entered it after its own exchange), then the step's record. A failure before the agreement
  // rolls back to the step before, whose record was the last written: only this step is redone.
  const auto t0 = std::chrono::steady_clock::now();
  agree_snapshots_everywhere();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Run::agree_snapshots_everywhere() {
  snapshots_->wait();
  at::Tensor done = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(session_.pg.device()));
  comm::all_reduce(session_.pg, done);
}

void Run::begin_recovery() {
  if (recovery0_) return;
  const comm::Traffic now = comm::traffic();
  recovery0_ = Sent{now.ring_bytes_sent, now.across_nodes_sent};
}

void Run::regroup(Strategy& strategy, int64_t next, double recovery_s) {
  const comm::ProcessGroup& pg = session_.pg;
  strategy_ = &strategy;
  plan_ = strategy.plan();
  const std::vector<double> base = lr_.base();  // (the run's, as it was: a resumed checkpoint's)
  lr_ = optim::LrScheduler(strategy.optimizer(), cfg_.lr_schedule_of());
  lr_.set_base(base);
  // (the same epoch order and global batch: the step's positions dealt over the new ranks)
  TORCH_CHECK(plan_.batch.global == data_.global_batch, "elastic regroup: a global batch of ", plan_.batch.global,
              " at ", pg.size(), " ranks, ", data_.global_batch, " before (a bug: please report it)");
  const int64_t per_step = plan_.batch.micro * plan_.batch.accumulation;  // (the most a rank takes)
  scaling_.regroup(pg);
  if (cfg_.save_async && !cfg_.save.empty() && !cfg_.eval_only) {  // (before the snapshots, as a joiner's Run makes them)
    abandon_save();  // (a retry's: the saver of a failed attempt)
    saver_ = std::make_unique<checkpoint::AsyncSaver>(pg);
    reserved_ = false;
  }
  const int64_t redone = std::max<int64_t>(0, committed_ - next);  // (rolled back: Design note [sharded state in process])
  if (redone > 0) redone_until_ = committed_;
  committed_ = next;
  if (snapshots_) make_snapshots();
  if (pg.rank() != 0) return;
  if (!cfg_.metrics.empty() && !metrics_.enabled()) metrics_ = MetricsWriter(cfg_.metrics, /*append=*/true);
  // (a step rolled back whose record was never written, --snapshot-sync's in flight, is not "redone")
  if (redone > 0 && metrics_.enabled()) redone_until_ = std::min<int64_t>(redone_until_, last_step_recorded(cfg_.metrics));
  // (a new rank 0 writes a new event file beside the lost writer's: TensorBoard reads a directory's
  // files as one run)
  if (!cfg_.tensorboard.empty() && !tensorboard_.enabled()) tensorboard_ = TensorBoardWriter(cfg_.tensorboard);
  // The last committed step's record, where its writer died (or its save failed) before writing it:
  // every rank gathered the step's report before the vote.
  if (last_report_ && metrics_.enabled() && last_step_recorded(cfg_.metrics) == next - 1) {
    step_ = next - 1;
    report(*last_report_);
  }
  const Membership& m = session_.elastic->membership();
  const std::string ids = join_ids(m.ids);
  std::printf("%s: generation %d: %d rank(s) (first ranks %s) go on from step %lld, %lld sample(s) per rank per step "
              "(%lld x %lld), after %.2f s\n", cfg_.program.c_str(), m.generation, pg.size(), ids.c_str(),
              static_cast<long long>(next + 1), static_cast<long long>(per_step), static_cast<long long>(plan_.batch.micro),
              static_cast<long long>(plan_.batch.accumulation), recovery_s);
  if (redone > 0) {
    std::printf("%s: the sharded state rolled back to the partner snapshots of step %lld: step(s) %lld-%lld are redone\n",
                cfg_.program.c_str(), static_cast<long long>(next), static_cast<long long>(next + 1),
                static_cast<long long>(next + redone));
  }
  std::fflush(stdout);
  metrics_.write(JsonLine().add("elastic", true).add("generation", static_cast<int64_t>(m.generation))
                     .add("world_size", static_cast<int64_t>(pg.size())).add("members", ids).add("from_step", next + 1)
                     .add("global_batch", plan_.batch.global).add("micro_batch", plan_.batch.micro).add("accumulation", plan_.batch.accumulation)
                     .add("recovery_s", recovery_s).add("redone_steps", redone));
}

double Run::wait_for_copies() {
  copy_pending_ = false;
  return (saver_ ? saver_->copied() : 0.0) + (snapshots_ ? snapshots_->packed() : 0.0);
}

void Run::report(const StepReport& r) {
  const int64_t s = step_ + 1;
  const double tokens_per_s = tokens_per_step_ / r.dt;
  const double lr = r.lr;
  progress_.update(s, r.loss, tokens_per_s);
  JsonLine line;
  if (r.grad_norm >= 0) line.add("grad_norm", r.grad_norm);  // before clipping, over all ranks
  add_traffic(line, traffic0_, comm::traffic(), r.across_nodes_mib);
  if (r.recovery_mib >= 0) line.add("recovery_mib", r.recovery_mib).add("recovery_mib_across_nodes", r.recovery_across_mib);
  if (scaling_.enabled()) line.add("loss_scale", r.loss_scale).add("skipped", static_cast<int64_t>(r.stepped ? 0 : 1));
  if (r.pipeline_idle >= 0) line.add("pipeline_idle", r.pipeline_idle);
  // A save's stall (what this step waited: the whole save, or with --save-async the copy and any
  // wait for the previous save), this rank's bytes, and a background write's time once it ended.
  if (r.checkpoint_stall_s >= 0) line.add("checkpoint_stall_s", r.checkpoint_stall_s);
  if (r.checkpoint_mib >= 0) line.add("checkpoint_mib", r.checkpoint_mib);
  if (r.checkpoint_write_s >= 0) line.add("checkpoint_write_s", r.checkpoint_write_s);
  if (r.checkpoint_write_cpu_s >= 0) line.add("checkpoint_write_cpu_s", r.checkpoint_write_cpu_s);  // (the writer thread's cost)
  if (r.snapshot_s >= 0) line.add("snapshot_s", r.snapshot_s);  // (a partner snapshot's time, this rank's)
  // The background copy of a save's steady state: what this step's optimizer step waited for it
  // (rank 0's; part of the save's stall), and the copy's own time once its save finished.
  if (r.copy_wait_s >= 0) line.add("checkpoint_copy_wait_s", r.copy_wait_s);
  if (r.checkpoint_copy_s >= 0) line.add("checkpoint_copy_s", r.checkpoint_copy_s);
  if (r.val_loss) {
    line.add("val_loss", *r.val_loss);
    std::printf("%s: step %lld: validation loss %.6g over %lld held-out samples\n", cfg_.program.c_str(),
                static_cast<long long>(s), *r.val_loss, static_cast<long long>(eval_samples()));
    std::fflush(stdout);
  }
  const int world = session_.pg.size();
  if (const double u = mfu(tokens_per_s, fo_.flops_per_token, peak_tflops_, world)) line.add("mfu", u);
  if (s <= redone_until_) line.add("redone", true);  // (again, after an elastic roll-back)
  metrics_.write(line.add("step", s).add("loss", r.loss).add("tokens_per_s", tokens_per_s).add("lr", lr)
                     .add("step_time_s", r.dt).add("forward_s", fwd_s_).add("backward_s", bwd_s_)
                     .add("optimizer_s", r.optimizer_s).add("peak_rss_mib", r.rss));
  if (!tensorboard_.enabled()) return;
  tensorboard_.add_scalar("train/loss", r.loss, s);
  tensorboard_.add_scalar("train/tokens_per_s", tokens_per_s, s);
  tensorboard_.add_scalar("train/lr", lr, s);
  if (r.val_loss) tensorboard_.add_scalar("val/loss", *r.val_loss, s);
  if (r.grad_norm >= 0) tensorboard_.add_scalar("train/grad_norm", r.grad_norm, s);
  if (scaling_.enabled()) tensorboard_.add_scalar("train/loss_scale", r.loss_scale, s);
  tensorboard_.add_scalar("memory/peak_rss_mib", r.rss, s);
  tensorboard_.flush();
}

}  // namespace dtrain::train::detail
