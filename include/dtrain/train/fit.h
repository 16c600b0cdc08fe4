#pragma once
// The training loop in the library: train::fit(session, model, dataset, loss_fn, cfg, hooks) trains
// any libtorch module under the strategy cfg names (make_parallel), with gradient accumulation,
// autocast, loss scaling, clipping, checkpoints (save, resume at any world size or strategy),
// weight export, a metrics JSON-lines file and a progress line, as dtrain-gpt does.
//
//   Dataset: anything with  int64_t size() const  and
//            std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices) const
//            (inputs and targets of those samples, stacked on dim 0; dtrain::data::TextDataset,
//            train::TensorDataset);
//   loss_fn: at::Tensor(const Output& model_output, const at::Tensor& targets), the mean loss.
//
// Data order: a DistributedSampler (shuffle, seed, drop_last) per rank; each step takes
// batch-size x grad-accum consecutive samples of the rank's list. Because the sampler deals
// samples round-robin, step t of any world size W covers global positions [t*G, (t+1)*G) of the
// epoch's permutation (G = W x batch-size x grad-accum), and an epoch has floor(N / G) steps for
// every W: equal global batches give the same samples at every step, so W ranks x batch B trains
// like one process x batch W*B (tested for every strategy at W = 1, 2, 3).
//
// One step (Design note [loss scaling in the loop], loss_scaling.h): zero_grad; for each
// micro-batch (all but the last under no_sync) forward under autocast, backward of the scaled
// loss; unscale the gradients this rank holds; clip (when finite); step unless a rank found
// inf/NaN; one small all_gather of every rank's loss and peak RSS for the report.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/flight_recorder.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/data/distributed_sampler.h"
#include "dtrain/train/checkpointing.h"
#include "dtrain/train/config.h"
#include "dtrain/train/loss_scaling.h"
#include "dtrain/train/metrics.h"
#include "dtrain/train/planner.h"
#include "dtrain/train/progress.h"
#include "dtrain/train/tensorboard.h"
#include "dtrain/train/session.h"
#include "dtrain/train/strategy.h"
#include "dtrain/util/system.h"

namespace dtrain::train {

// Inputs and targets held whole, one sample per row (a dataset for fit made from tensors).
struct TensorDataset {
  at::Tensor inputs, targets;
  int64_t size() const { return inputs.size(0); }
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices) const {
    auto idx = at::tensor(indices, at::kLong);
    return {inputs.index_select(0, idx), targets.index_select(0, idx)};
  }
};

struct FitOptions {
  // tokens_per_s counts samples x tokens_per_sample (a sequence of T tokens: T; else 1).
  int64_t tokens_per_sample = 1;
  // Training FLOPs per token, for the mfu metric (0: no mfu).
  double flops_per_token = 0;
  // Printed by rank 0 after the strategy line (e.g. "GPT 4 layers, d_model 128 (0.85M parameters)").
  std::string model_description;
};

struct FitResult {
  int64_t start_step = 0;    // the step a resumed run went on from
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
void print_start(const TrainConfig& cfg, const Session& s, const FitOptions& fo, int64_t parameters,
                 int64_t global_batch, int64_t steps_per_epoch, int64_t samples);
// The summary line and the final metrics record (collective: memory of every rank).
// tensor_peak: this rank's most live tensor bytes during the steps (util/memory.h); predicted: the
// memory plan's peak for the strategy trained (-1: not planned).
FitResult finish(const TrainConfig& cfg, const Session& s, Strategy& strategy, const LossScaling& scaling,
                 MetricsWriter& metrics, int64_t start, double total_time, double tokens_per_step,
                 double peak_tflops, const FitOptions& fo, int64_t parameters, int64_t tensor_peak, int64_t predicted);
// --plan with --metrics: one record per candidate (rank 0).
void write_plan(const TrainConfig& cfg, const MemoryPlan& plan);
}  // namespace detail

namespace detail {
// The loop: trains `model` under cfg (a strategy named, not auto). predicted: the memory plan's peak
// for it (-1: not planned), for the final record.
template <class Model, class Dataset, class LossFn>
FitResult train_loop(Session& session, Model model, const Dataset& dataset, LossFn loss_fn, const TrainConfig& cfg,
                     ModelHooks hooks, const FitOptions& fo, int64_t predicted);
// Prints the plan (rank 0); with --plan writes its records, and with --strategy auto checks that
// something fits (the error names the smallest need). Whether to train.
bool report_plan(const Session& session, const TrainConfig& cfg, const MemoryPlan& plan);
}  // namespace detail

template <class Model, class Dataset, class LossFn>
FitResult fit(Session& session, Model model, const Dataset& dataset, LossFn loss_fn, const TrainConfig& given,
              ModelHooks hooks = {}, const FitOptions& fo = {}) {
  if (given.strategy != "auto" && !given.plan) {
    return detail::train_loop(session, model, dataset, loss_fn, given, std::move(hooks), fo, -1);
  }
  // --strategy auto / --plan: the memory planner on the model as given (train/planner.h).
  const MemoryPlan plan = plan_for(session, model, dataset, loss_fn, given, hooks);
  if (!detail::report_plan(session, given, plan)) return {};
  util::trim_heap_and_reset_peak_rss();  // (the run's peak RSS is the training's from here: Design note [memory plan])
  return detail::train_loop(session, model, dataset, loss_fn, with_choice(given, plan), std::move(hooks), fo,
                            chosen(plan).total());
}

// Design note [planned layouts]
// Tensor parallelism changes the model a program builds (its layers cut on the layout's tensor
// group), so a planner that weighs it must build the model once per layout. A program that trains
// through this overload hands the loop a build function instead of a model:
//
//   build(const TrainConfig& c, Use&& use)   builds the model c names (c.tp > 1: on the groups of
//       train::make_groups(c, session.pg), given to hooks.groups) and calls
//       use(model, loss_fn, hooks, fit_options) once with it; it throws std::invalid_argument
//       (before or after make_groups, alike on every rank) for a layout it cannot build.
//
// With a strategy named, fit builds cfg's model and trains it. With --strategy auto or --plan it
// builds the plain model and, for each TP degree that divides the world size (with and without
// sequence parallelism), the model for that degree, and for each PP degree the model cut into
// stages; measures each (measure_for; PP: measure_pipeline's trial steps; each measurement
// restores the default random state, and the whole planning restores it again at its end, so
// planning leaves no trace); prints the one table; then
// builds the chosen layout's model afresh and trains it. Models built for measuring are dropped
// before the next is built, so two are never alive at once (a dropped model's process groups live on
// in its layout's hooks.groups until then).
template <class Dataset, class Build>
FitResult fit(Session& session, const Dataset& dataset, const TrainConfig& cfg, Build&& build) {
  FitResult result;
  bool built = false;
  auto train_with = [&](const TrainConfig& c, int64_t predicted) {
    build(c, [&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions& fo) {
      TORCH_CHECK(!built, cfg.program, ": the build function called use() twice; call it once with the model");
      built = true;
      result = detail::train_loop(session, model, dataset, loss_fn, c, std::move(hooks), fo, predicted);
    });
    TORCH_CHECK(built, cfg.program, ": the build function returned without calling use(model, loss_fn, hooks, options)");
    return result;
  };
  if (cfg.strategy != "auto" && !cfg.plan) return train_with(cfg, -1);

  MemoryPlan plan;
  {
    detail::RandomStateGuard rng(session.device);
    bool measured = false;
    build(cfg, [&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions&) {
      plan = plan_for(session, model, dataset, loss_fn, cfg, hooks);
      measured = true;
    });
    TORCH_CHECK(measured, cfg.program, ": the build function returned without calling use(model, loss_fn, hooks, options)");
    const int world = session.pg.size();
    // One layout: its model built and `measure` run on it. A std::invalid_argument while it is
    // built (the build before use(), or make_parallel cutting the stages: alike on every rank, a
    // degree the model does not take) lists the layout as not built; anything thrown once the
    // measurement ran (measure calls `running()` first: from there on inside collectives) goes on up.
    auto weigh = [&](TrainConfig c, const std::string& name, auto&& measure) {
      bool used = false, running = false;
      try {
        c.validate();  // (PP: sets the micro-batches and the schedule)
        build(c, [&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions&) {
          used = true;
          measure(c, model, loss_fn, std::move(hooks), [&running] { running = true; });
        });
      } catch (const std::invalid_argument& e) {
        if (running) throw;
        plan.not_built.push_back(name + ": " + e.what());
        return;
      }
      TORCH_CHECK(used, cfg.program, ": the build function returned without calling use(model, loss_fn, hooks, "
                  "options) for ", name);
    };
    for (int tp = 2; tp <= world; ++tp) {
      if (world % tp != 0) continue;
      for (bool sp : {false, true}) {
        TrainConfig c = cfg;  // (the groups are the same for every strategy around TP: measured under one)
        c.strategy = tp == world ? "single" : cfg.fsdp() || cfg.strategy == "ddp" ? cfg.strategy : "ddp";
        if (!c.fsdp()) c.drop_sharding_flags();
        c.tp = tp;
        c.sequence_parallel = sp;
        c.plan = false;
        c.memory_budget = 0;
        weigh(c, "tp" + std::to_string(tp) + (sp ? "+sp" : ""), [&](const TrainConfig& v, auto model, auto loss_fn,
                                                                   ModelHooks hooks, auto running) {
          running();
          const ModelFacts facts = measure_for(session, model, dataset, loss_fn, v, hooks);
          add_candidates(plan, tensor_parallel_candidates(cfg, world, tp, sp, facts));
        });
      }
    }
    // Pipeline parallelism: each layout built and tried (measure_pipeline), single or ddp around.
    for (int pp = 2; pp <= world; ++pp) {
      if (world % pp != 0) continue;
      for (bool recompute : {false, true}) {
        if (!recompute && cfg.activation_checkpointing) continue;
        TrainConfig c = cfg;
        c.strategy = pp == world ? "single" : "ddp";
        c.drop_sharding_flags();
        c.pp = pp;
        c.activation_checkpointing = recompute;
        c.plan = false;
        c.memory_budget = 0;
        const std::string name = "pp" + std::to_string(pp) + (pp == world ? "" : "+ddp") + (recompute ? "+recompute" : "");
        const int64_t other = util::live_bytes(session.device);  // (the program's tensors: the data, ...)
        weigh(c, name, [&](const TrainConfig& v, auto model, auto loss_fn, ModelHooks hooks, auto running) {
          add_candidates(plan, {measure_pipeline(session, model, dataset, loss_fn, v, std::move(hooks), name, other, running)});
        });
      }
    }
  }
  if (!detail::report_plan(session, cfg, plan)) return {};
  util::trim_heap_and_reset_peak_rss();  // (the run's peak RSS is the training's from here: Design note [memory plan])
  return train_with(with_choice(cfg, plan), chosen(plan).total());
}

namespace detail {
template <class Model, class Dataset, class LossFn>
FitResult train_loop(Session& session, Model model, const Dataset& dataset, LossFn loss_fn, const TrainConfig& cfg,
                     ModelHooks hooks, const FitOptions& fo, int64_t predicted) {
  const comm::ProcessGroup& pg = session.pg;
  const c10::Device device = session.device;
  const int rank = pg.rank(), world = pg.size();
  const int64_t parameters = detail::count_parameters(*model);  // before FSDP shards them
  if (cfg.pp > 1 && !hooks.loss) {
    hooks.loss = [loss_fn](const at::Tensor& out, const at::Tensor& y) mutable { return loss_fn(out, y); };
  }
  Parallel<Model> parallel = make_parallel(model, cfg, pg, hooks);
  Strategy& strategy = parallel.strategy();
  // The ranks that take different samples: the data-parallel ranks of the layout (the ranks of one
  // pipeline or tensor-parallel group take the same samples).
  const int dp = strategy.layout().data_parallel(), dp_rank = strategy.layout().data_parallel_rank(rank);
  data::DistributedSampler sampler(dataset.size(), data::DistributedSamplerOptions(dp, dp_rank)
                                                       .shuffle(true).seed(static_cast<int64_t>(cfg.seed)).drop_last(true));
  const int64_t per_step = cfg.batch_size * cfg.grad_accum;  // samples per data-parallel rank per step
  const int64_t steps_per_epoch = sampler.num_samples() / per_step;
  TORCH_CHECK(steps_per_epoch >= 1, "the data (", dataset.size(), " samples) is too small for a global batch of ",
              per_step * dp, " samples: lower --batch-size/--grad-accum or give more data");
  LossScaling scaling(cfg, pg);
  if (rank == 0) detail::print_start(cfg, session, fo, parameters, per_step * dp, steps_per_epoch, dataset.size());

  // --resume: the model, optimizer and random state of the checkpoint, and the step to go on from.
  const DataPlan plan{dataset.size(), per_step * dp, steps_per_epoch};
  const int64_t start = resume_checkpoint(cfg, pg, strategy, scaling, plan);

  MetricsWriter metrics = rank == 0 && !cfg.metrics.empty() ? MetricsWriter(cfg.metrics) : MetricsWriter();
  TensorBoardWriter tensorboard = rank == 0 && !cfg.tensorboard.empty() ? TensorBoardWriter(cfg.tensorboard)
                                                                       : TensorBoardWriter();
  Progress progress(cfg.steps, Progress::stdout_is_interactive());
  const double peak_tflops = cfg.peak_tflops > 0 ? cfg.peak_tflops : util::known_peak_tflops(util::device_name(device));
  const double tokens_per_step = static_cast<double>(per_step * dp * fo.tokens_per_sample);
  std::vector<int64_t> order;
  int64_t epoch = -1;
  double total_time = 0;
  util::reset_peak_bytes(device);  // (the steps' peak, for the final record)

  for (int64_t step = start; step < cfg.steps; ++step) {
    maybe_fail_for_test(cfg.program, step + 1, rank, world);
    const auto t0 = std::chrono::steady_clock::now();
    if (step / steps_per_epoch != epoch) {
      epoch = step / steps_per_epoch;
      sampler.set_epoch(epoch);
      order = sampler.indices();
    }
    const int64_t first = (step % steps_per_epoch) * per_step;
    const int64_t traffic0 = comm::traffic().ring_bytes_sent;
    strategy.zero_grad();
    double local_loss = 0, fwd_s = 0, bwd_s = 0, pipe_compute_s = 0, pipe_wall_s = 0;
    for (int64_t m = 0; m < cfg.grad_accum; ++m) {
      std::vector<int64_t> idx(order.begin() + first + m * cfg.batch_size,
                               order.begin() + first + (m + 1) * cfg.batch_size);
      auto [x_cpu, y_cpu] = dataset.batch(idx);
      const at::Tensor x = x_cpu.to(device), y = y_cpu.to(device);
      if (pipeline::Pipeline* pipe = strategy.pipeline()) {  // --pp: forwards and backwards of every micro-batch
        const auto f0 = std::chrono::steady_clock::now();
        const double multiplier = (scaling.enabled() ? scaling.current_scale() : 1.0) / static_cast<double>(cfg.grad_accum);
        std::optional<amp::AutocastGuard> autocast;  // the stages' forwards (and their recomputation) in bf16/fp16
        if (cfg.precision != "fp32") autocast.emplace(device.type(), compute_dtype(cfg));
        local_loss += pipe->step(x, y, multiplier) / static_cast<double>(cfg.grad_accum);
        pipe_compute_s += pipe->last_step_times().compute_s;
        pipe_wall_s += pipe->last_step_times().wall_s;
        fwd_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
        continue;
      }
      auto guard = m + 1 == cfg.grad_accum ? nullptr : strategy.no_sync();
      const auto f0 = std::chrono::steady_clock::now();
      at::Tensor loss;
      {
        std::optional<amp::AutocastGuard> autocast;  // bf16 or fp16 on the device's type
        if (cfg.precision != "fp32") autocast.emplace(device.type(), compute_dtype(cfg));
        loss = loss_fn(parallel.forward(x), y) / static_cast<double>(cfg.grad_accum);
      }
      const auto f1 = std::chrono::steady_clock::now();
      scaling.scale(loss).backward();  // with ddp: ends after the last bucket's all-reduce is written back
      fwd_s += std::chrono::duration<double>(f1 - f0).count();
      bwd_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - f1).count();
      local_loss += loss.template item<double>();
    }
    strategy.after_backward();
    const auto o0 = std::chrono::steady_clock::now();
    const double loss_scale = scaling.current_scale();
    const bool finite = scaling.unscale(strategy, step + 1);
    const double grad_norm = cfg.clip_grad_norm > 0 && finite ? strategy.clip_grad_norm(cfg.clip_grad_norm) : -1.0;
    const bool stepped = scaling.step(strategy, step + 1);
    const double opt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - o0).count();
    // One small collective for the step's report: every rank's loss and peak RSS (and with --pp its
    // pipeline's compute and wall time).
    auto mine = at::tensor(std::vector<double>{local_loss, util::peak_rss_mib(), pipe_compute_s, pipe_wall_s}, at::kDouble)
                    .to(pg.device());
    auto all = at::empty({4 * world}, at::TensorOptions().dtype(at::kDouble).device(pg.device()));
    comm::all_gather(pg, all, mine);
    all = all.to(at::kCPU);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    total_time += dt;
    auto per_rank = all.view({world, 4});
    const double loss = per_rank.select(1, 0).mean().template item<double>();
    const double rss = per_rank.select(1, 1).max().template item<double>();
    // A diverged run stops (every rank sees the same mean loss and global norm: all stop alike).
    detail::check_finite(cfg, step + 1, loss, grad_norm, scaling.enabled());
    if (rank == 0) {
      progress.update(step + 1, loss, tokens_per_step / dt);
      JsonLine line;
      if (grad_norm >= 0) line.add("grad_norm", grad_norm);  // before clipping, over all ranks
      // What rank 0 sent this step by ring algorithms (comm/traffic.h), the report's all-gather included.
      line.add("comm_mib_sent", static_cast<double>(comm::traffic().ring_bytes_sent - traffic0) / 1048576.0);
      if (scaling.enabled()) line.add("loss_scale", loss_scale).add("skipped", static_cast<int64_t>(stepped ? 0 : 1));
      if (strategy.pipeline()) {  // measured: 1 - sum of compute / (ranks x the slowest rank's pipeline time)
        const double wall = per_rank.select(1, 3).max().template item<double>();
        const double compute = per_rank.select(1, 2).sum().template item<double>();
        if (wall > 0) line.add("pipeline_idle", 1.0 - compute / (world * wall));
      }
      if (const double u = detail::mfu(tokens_per_step / dt, fo.flops_per_token, peak_tflops, world)) line.add("mfu", u);
      metrics.write(line.add("step", step + 1).add("loss", loss).add("tokens_per_s", tokens_per_step / dt)
                        .add("step_time_s", dt).add("forward_s", fwd_s).add("backward_s", bwd_s)
                        .add("optimizer_s", opt_s).add("peak_rss_mib", rss));
      if (tensorboard.enabled()) {
        const int64_t s = step + 1;
        tensorboard.add_scalar("train/loss", loss, s);
        tensorboard.add_scalar("train/tokens_per_s", tokens_per_step / dt, s);
        tensorboard.add_scalar("train/lr", strategy.optimizer().param_groups().at(0).options().get_lr(), s);
        if (grad_norm >= 0) tensorboard.add_scalar("train/grad_norm", grad_norm, s);
        if (scaling.enabled()) tensorboard.add_scalar("train/loss_scale", loss_scale, s);
        tensorboard.add_scalar("memory/peak_rss_mib", rss, s);
        tensorboard.flush();
      }
    }
    if (save_due(cfg, step + 1)) save_checkpoint(cfg, pg, strategy, scaling, plan, step + 1);
    comm::flight::note_step(step + 1);  // (shown in dtrun's stall reports)
  }
  if (rank == 0) progress.finish();
  if (!cfg.export_weights.empty()) export_weights(cfg, pg, strategy);
  const int64_t tensor_peak = util::peak_bytes(device);
  return detail::finish(cfg, session, strategy, scaling, metrics, start, total_time, tokens_per_step, peak_tflops, fo,
                        parameters, tensor_peak, predicted);
}

}  // namespace detail

}  // namespace dtrain::train
