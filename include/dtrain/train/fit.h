#pragma once
// The training loop in the library: train::fit(session, model, dataset, loss_fn, cfg, hooks) trains
// any libtorch module under the plan the request names (train/plan.h, train/parallelize.h), with
// gradient accumulation, autocast, loss scaling, clipping, checkpoints (save, resume under any plan
// or world size), weight export, a metrics JSON-lines file and a progress line, as dtrain-gpt does.
//
//   Dataset: anything with  int64_t size() const  and
//            std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices) const
//            (inputs and targets of those samples, stacked on dim 0; dtrain::data::TextDataset,
//            train::TensorDataset);
//   loss_fn: at::Tensor(const Output& model_output, const at::Tensor& targets), the mean loss.
//
// Held-out samples: --val-fraction F holds out the last F of the dataset's samples (hold_out); a
// program that reads its own (--val-data) passes them as `val`. --eval-every N evaluates them
// (Design note [evaluation], src/train/evaluate.cpp).
//
// The data order and one step: train/run.h. Every plan trains the global batch the request asks
// for (Design note [the global batch], train/plan.h).
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/train/config.h"
#include "dtrain/train/parallelize.h"
#include "dtrain/train/plan.h"
#include "dtrain/train/plan_layouts.h"
#include "dtrain/train/recovery.h"
#include "dtrain/train/planner.h"
#include "dtrain/train/run.h"
#include "dtrain/train/session.h"
#include "dtrain/util/memory.h"

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

// Samples [first, first + count) of a dataset, as a dataset (what --val-fraction splits a dataset into).
template <class Dataset>
struct SampleRange {
  const Dataset* dataset = nullptr;
  int64_t first = 0, count = 0;
  int64_t size() const { return count; }
  std::pair<at::Tensor, at::Tensor> batch(std::vector<int64_t> indices) const {
    for (auto& i : indices) i += first;
    return dataset->batch(indices);
  }
};

// {the first N - V samples, the last V = floor(fraction x N)}: --val-fraction's training and
// held-out samples. Throws c10::Error when either part would be empty.
template <class Dataset>
std::pair<SampleRange<Dataset>, SampleRange<Dataset>> hold_out(const Dataset& d, double fraction) {
  const int64_t n = d.size(), held = static_cast<int64_t>(fraction * static_cast<double>(n));
  TORCH_CHECK(held >= 1 && held < n, "--val-fraction ", fraction, " of ", n, " samples holds out ", held,
              ": it must leave samples on both sides");
  return {SampleRange<Dataset>{&d, 0, n - held}, SampleRange<Dataset>{&d, n - held, held}};
}

namespace detail {
// Prints the memory plan (rank 0); with --plan writes its records, and with --strategy auto checks
// that something fits (the error names the smallest need). Whether to train.
bool report_plan(const Session& session, const TrainConfig& cfg, const MemoryPlan& plan);
// --plan with --metrics: one record per candidate (rank 0).
void write_plan(const TrainConfig& cfg, const MemoryPlan& plan);

// What `f` returns; where it throws what no retry recovers from (the plan at the new size does not
// fit, the memory budget; not a failed collective or an aborted group: the retry's), the change is
// refused: dtrun is asked to restart from the newest checkpoint (Elastic::request_restart) and the
// error goes on.
template <class F>
auto refused_unless(F f, Session& session) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    if (!recoverable(e, session)) {
      try {
        session.elastic->request_restart(e.what());
      } catch (const std::exception&) {  // (the store unreachable: the error that matters is e)
      }
    }
    throw;
  }
}

// --elastic (Design note [in-process recovery], train/elastic.h): after a failure (`why`) or with
// processes waiting to join (""), the next generation's group, the plan at its size, the model put
// under it again, the optimizer state handed over, the run going on; the joiners given the state.
// A failure during this is recovered from the same way (three tries). facts: --memory-budget's
// (elastic_facts, planner.h; nullptr: nothing checked).
template <class Model>
void regroup_and_rebuild(Session& session, std::optional<Parallel<Model>>& parallel, Model model, const TrainConfig& cfg,
                         const ModelHooks& hooks, Run& run, std::string why, const ModelFacts* facts) {
  const auto t0 = std::chrono::steady_clock::now();
  run.begin_recovery();
  const int64_t committed = run.committed();  // (a retry regroups from here too, whatever a roll-back made of it)
  // (where the state the survivors offer was written: the old strategy's, for every try; in whole
  // units, the copies themselves, taken once before any load: a load writes into tensors the old
  // strategy shares)
  const bool in_units = state_in_units(parallel->strategy().plan());
  std::optional<checkpoint::HeldState> copies;
  OldPlace old_place{session.pg.rank(), session.pg.size(), nullptr};
  trace(session, "recovery begins: " + (why.empty() ? std::string("processes join") : why.substr(0, 160)));
  for (int attempt = 1;; ++attempt) {
    try {
      // The last partner snapshot's exchange ends in the old generation: growing, while every member
      // is still in it (a member that went on first would make the others' watchers abort theirs
      // and leave its own waiting); after a failure, aborted with the old groups once regrouped.
      const std::shared_ptr<comm::AbortSignal> old = session.pg.abort_signal();
      if (why.empty() && run.snapshots()) run.snapshots()->wait();
      if (why.empty()) run.finish_save();  // (likewise a background save: committed by every member)
      regroup_session(session, why, committed);
      trace(session, "regrouped");
      old->abort("the job regrouped");
      run.abandon_save();  // (after a failure its save is cut, not committed; before the state is rebuilt)
      const parallel::Plan next = refused_unless([&] { return make_plan(cfg, session); }, session);
      session.elastic->set_units(units_of(next));  // (the same degrees: whole units keep them dividing the world)
      parallel::Groups groups = make_groups(next, session.pg);
      if (facts) {  // (Design note [memory plan]: every rank stops, refused: dtrun's restart path)
        refused_unless([&] { check_elastic_budget(session, cfg, next, *facts); }, session);
      }
      if (hooks.groups) repoint_model_groups(*hooks.groups, groups, *session.elastic);  // (--tp: the model's own group)
      // (--tp: the pieces gathered whole over the re-pointed tensor group, so every member takes
      // them again on every try: the same collectives on every rank; a try that failed after a
      // load wrote the units' replicated values, the same ones)
      if (in_units && (!copies || next.layout.tensor > 1)) {
        copies = held_copies(parallel->strategy(), committed, old_place.world);
        old_place.copies = &*copies;
      }
      parallel->strategy().release_model();  // (FSDP's module gets its parameters back, to be wrapped again)
      Parallel<Model> rebuilt = parallelize(model, next, groups, hooks);
      int64_t from = committed;
      bool hook_state_back = false;  // (--grad-compression: the hook's own state re-split with the rest)
      if (state_sharded(next)) {  // (Design note [sharded state in process], recovery.h)
        const checkpoint::HeldState held =
            held_for_regroup(session, &parallel->strategy(), run.snapshots(), from, /*grow=*/why.empty(), old_place);
        checkpoint::load_from_peers(session.pg, held,
                                    [&](const checkpoint::Reader& r) { hook_state_back = rebuilt.strategy().load_state(r); });
        if (!copies) run.restore_scaling(held.metadata);  // (the scaler as it was at the step rolled back to; in units: as it is)
        from = held.step;
      } else {
        move_optimizer_state(parallel->strategy(), rebuilt.strategy());
      }
      // (--grad-compression: a hook's state comes back only from the snapshots, taken at a commit;
      // live copies may hold a dropped step's half-made state)
      if (!hook_state_back || copies) rebuilt.strategy().continue_compression_at(from);
      parallel.reset();
      parallel.emplace(std::move(rebuilt));
      trace(session, "state rebuilt");
      run.regroup(parallel->strategy(), from, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      maybe_fail_for_test(cfg.program, committed + 1, session.pg.rank(), session.pg.size(), "regroup");  // (test hook)
      if (!session.elastic->membership().newcomers.empty()) run.share_state();
      run.snapshot_generation_start();
      trace(session, "the generation's first snapshot taken");
      return;
    } catch (const std::exception& again) {
      if (attempt == 3 || !recoverable(again, session)) throw;
      why = again.what();
    }
  }
}

// --elastic where one unit holds the only copy of the state (a restart's smaller world, say): rank 0
// says that a loss then fails the round (dtrun's restart path).
inline void say_if_one_unit(const Session& session, const TrainConfig& cfg, const parallel::Plan& plan, const Units& units) {
  if (units.size() != session.pg.size() || units.size() == 1 || session.pg.rank() != 0) return;
  std::printf("%s: --elastic: under %s one unit of %d ranks holds the only copy of the state: a lost rank leaves no "
              "whole copy, so it fails the round (dtrun's restart path) instead of being recovered in process; "
              "processes that join still grow the run (more ranks than --tp x --pp, or hsdp's --shard-size smaller "
              "than the world, keep a copy)\n",
              cfg.program.c_str(), plan.name().c_str(), units.size());
  std::fflush(stdout);
}

// The loop: trains `model` under `plan` (validated). predicted: the memory plan's peak for it (-1:
// not planned), for the final record.
// val: the held-out samples (nullptr: none).
template <class Model, class Dataset, class Val, class LossFn>
FitResult train_loop(Session& session, Model model, const Dataset& dataset, const Val* val, LossFn loss_fn,
                     const TrainConfig& cfg, const parallel::Plan& plan, ModelHooks hooks, const FitOptions& fo,
                     int64_t predicted) {
  const int64_t parameters = count_parameters(*model);  // (before FSDP shards them)
  if (plan.layout.pipeline > 1 && !hooks.loss) {
    hooks.loss = [loss_fn](const at::Tensor& out, const at::Tensor& y) mutable { return loss_fn(out, y); };
  }
  if (!hooks.optimizer) hooks.optimizer = optimizer_factory(cfg);
  const ModelHooks kept = cfg.elastic ? hooks : ModelHooks{};  // (--elastic: parallelize again after a regroup)
  // (--elastic --memory-budget: the facts every generation's plan is counted from, the model still plain)
  const std::optional<ModelFacts> facts = elastic_facts(session, model, dataset, loss_fn, cfg, hooks, plan);
  if (facts) util::trim_heap_and_reset_peak_rss();  // (the run's peak RSS is the training's)
  parallel::Groups groups = hooks.groups ? *hooks.groups : make_groups(plan, session.pg);
  if (facts) check_elastic_budget(session, cfg, plan, *facts);
  std::optional<Parallel<Model>> parallel;
  parallel.emplace(parallelize(model, plan, groups, std::move(hooks)));
  if (session.elastic) {  // (Design note [whole units], elastic.h)
    const Units units = units_of(plan);
    say_if_one_unit(session, cfg, plan, units);
    session.elastic->set_units(units);
  }
  bool hook_state_back = false;  // (--grad-compression: a joiner's hook state, with its part)
  if (session.elastic && session.elastic->newcomer() && state_sharded(plan)) {  // (its part, from the live ranks)
    checkpoint::load_from_peers(session.pg, held_for_regroup(session, nullptr, nullptr, 0),
                                [&](const checkpoint::Reader& r) { hook_state_back = parallel->strategy().load_state(r); });
  }
  Run run(session, cfg, parallel->strategy(), dataset.size(), fo, parameters, predicted);
  const ForwardLoss forward_loss = [&](const at::Tensor& x, const at::Tensor& y) { return loss_fn(parallel->forward(x), y); };
  if (val) {
    run.set_validation(
        val->size(),
        [&](const std::vector<int64_t>& indices) {
          auto [x, y] = val->batch(indices);
          return std::make_pair(x.to(session.device), y.to(session.device));
        },
        [&](bool on) {
          parallel->train(on);
          if (pipeline::Pipeline* pipe = parallel->strategy().pipeline()) pipe->train(on);
        },
        forward_loss);
  }
  if (cfg.eval_only) return run.evaluate_only();
  if (session.elastic && session.elastic->newcomer()) {  // (a joining process: from the live ranks)
    run.share_state();
    if (!hook_state_back || state_in_units(plan)) parallel->strategy().continue_compression_at(run.committed());  // (as the members)
  }
  run.snapshot_generation_start();
  for (int64_t step = run.start(); step < cfg.steps; step = run.committed()) {
    try {
      run.begin_step(step);
      for (int64_t m = 0; m < parallel->strategy().plan().batch.accumulation; ++m) {
        auto [x, y] = dataset.batch(run.micro_batch(m));
        run.micro_step(m, x.to(session.device), y.to(session.device), forward_loss);
      }
      run.end_step();
      if (session.elastic && session.elastic->grow_due()) regroup_and_rebuild(session, parallel, model, cfg, kept, run, "", facts ? &*facts : nullptr);
    } catch (const std::exception& e) {
      // --elastic (Design note [in-process recovery], train/elastic.h): drop the step, regroup with
      // the survivors, rebuild the plan on the new group from the state held here, redo the step.
      if (!session.elastic || !detail::recoverable(e, session)) throw;
      regroup_and_rebuild(session, parallel, model, cfg, kept, run, e.what(), facts ? &*facts : nullptr);
    }
  }
  if (session.elastic) session.elastic->finish();  // (processes still waiting to join end)
  return run.finish();
}

// The loop over `dataset`'s training samples with `val` held out (nullptr: none).
template <class Model, class Dataset, class Val, class LossFn>
FitResult fit_model(Session& session, Model model, const Dataset& dataset, const Val* val, LossFn loss_fn,
                    const TrainConfig& cfg, ModelHooks hooks, const FitOptions& fo) {
  if (!cfg.planned()) return train_loop(session, model, dataset, val, loss_fn, cfg, make_plan(cfg, session), hooks, fo, -1);
  // --strategy auto / --plan: the memory planner on the model as given (train/planner.h).
  const MemoryPlan plan = plan_for(session, model, dataset, loss_fn, cfg, hooks);
  if (!report_plan(session, cfg, plan)) return {};
  util::trim_heap_and_reset_peak_rss();  // (the run's peak RSS is the training's from here: Design note [memory plan])
  const Candidate& c = chosen(plan);
  return train_loop(session, model, dataset, val, loss_fn, cfg, c.plan, std::move(hooks), fo, c.total());
}

// --val-data without a program that reads it is an error naming the way that needs none.
void check_val_data(const TrainConfig& cfg, bool given);

// f(training samples, held-out samples or nullptr): --val-fraction's split of `dataset`, or all of it.
template <class Dataset, class F>
FitResult with_held_out(const Dataset& dataset, const TrainConfig& cfg, F&& f) {
  check_val_data(cfg, false);
  if (cfg.val_fraction > 0) {
    const auto parts = hold_out(dataset, cfg.val_fraction);
    return f(parts.first, &parts.second);
  }
  return f(dataset, static_cast<const Dataset*>(nullptr));
}
}  // namespace detail

template <class Model, class Dataset, class LossFn>
FitResult fit(Session& session, Model model, const Dataset& dataset, LossFn loss_fn, const TrainConfig& cfg,
              ModelHooks hooks = {}, const FitOptions& fo = {}) {
  return detail::with_held_out(dataset, cfg, [&](const auto& train, const auto* val) {
    return detail::fit_model(session, model, train, val, loss_fn, cfg, std::move(hooks), fo);
  });
}

// The same with the program's own held-out samples (e.g. read from --val-data).
template <class Model, class Dataset, class Val, class LossFn>
FitResult fit(Session& session, Model model, const Dataset& dataset, const Val& val, LossFn loss_fn,
              const TrainConfig& cfg, ModelHooks hooks = {}, const FitOptions& fo = {}) {
  detail::check_val_data(cfg, true);
  return detail::fit_model(session, model, dataset, &val, loss_fn, cfg, std::move(hooks), fo);
}

// Design note [planned layouts]
// Tensor parallelism changes the model a program builds (its layers cut on the layout's tensor
// group), so a planner that weighs it must build the model once per layout. A program that trains
// through this overload hands the loop a build function instead of a model:
//
//   build(const parallel::Plan& p, Use&& use)   builds the model p names (p.layout.tensor > 1: on
//       the groups of train::make_groups(p, session.pg), given to hooks.groups) and calls
//       use(model, loss_fn, hooks, fit_options) once with it; it throws std::invalid_argument
//       (before or after make_groups, alike on every rank) for a layout it cannot build.
//
// With a strategy named, fit builds the plan's model and trains it. With --strategy auto or --plan
// it builds the plain model and, for each TP degree that divides the world size (with and without
// sequence parallelism), the model for that degree, for each PP degree the model cut into stages,
// and for each TP x PP layout both; measures each (measure_for; PP: measure_pipeline's trial
// steps; each measurement restores the default random state, and the whole planning restores it
// again at its end, so planning leaves no trace); prints the one table; then builds the chosen
// plan's model afresh and trains it. Models built for measuring are dropped before the next is
// built, so two are never alive at once.
namespace detail {
template <class Dataset, class Val, class Build>
FitResult fit_built(Session& session, const Dataset& dataset, const Val* val, const TrainConfig& cfg, Build&& build) {
  auto train = [&](const parallel::Plan& plan, int64_t predicted) {
    FitResult result;
    use_once(cfg, "", [&](auto&& use) { build(plan, use); }, [&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions& fo) {
      result = train_loop(session, model, dataset, val, loss_fn, cfg, plan, std::move(hooks), fo, predicted);
    });
    return result;
  };
  if (!cfg.planned()) return train(make_plan(cfg, session), -1);
  const MemoryPlan plan = plan_layouts(session, dataset, cfg, build);
  if (!report_plan(session, cfg, plan)) return {};
  util::trim_heap_and_reset_peak_rss();  // (the run's peak RSS is the training's from here: Design note [memory plan])
  const Candidate& c = chosen(plan);
  return train(c.plan, c.total());
}
}  // namespace detail

template <class Dataset, class Build>
FitResult fit(Session& session, const Dataset& dataset, const TrainConfig& cfg, Build&& build) {
  return detail::with_held_out(dataset, cfg, [&](const auto& train, const auto* val) {
    return detail::fit_built(session, train, val, cfg, build);
  });
}

// The same with the program's own held-out samples (e.g. read from --val-data).
template <class Dataset, class Val, class Build>
FitResult fit(Session& session, const Dataset& dataset, const Val& val, const TrainConfig& cfg, Build&& build) {
  detail::check_val_data(cfg, true);
  return detail::fit_built(session, dataset, &val, cfg, std::forward<Build>(build));
}

}  // namespace dtrain::train
