#pragma once
// The memory planner over every layout a program can build (Design note [planned layouts],
// train/fit.h): the plain model's data-parallel candidates, then tensor parallelism of each degree
// (with and without sequence parallelism), pipeline parallelism of each degree and both together,
// each layout's model built by the program's build function and measured.
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "dtrain/train/planner.h"
#include "dtrain/train/run.h"

namespace dtrain::train {
namespace detail {

// Calls `call(use)` with a `use(model, loss_fn, hooks, fit_options)` that runs `body` on them;
// throws unless the build function called it exactly once.
template <class Call, class Body>
void use_once(const TrainConfig& cfg, const std::string& what, Call&& call, Body&& body) {
  bool used = false;
  call([&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions& fo) {
    TORCH_CHECK(!used, cfg.program, ": the build function called use() twice; call it once with the model");
    used = true;
    body(model, loss_fn, std::move(hooks), fo);
  });
  TORCH_CHECK(used, cfg.program, ": the build function returned without calling use(model, loss_fn, hooks, options)", what);
}

// The model-parallel layouts the planner weighs on `world` ranks: (tensor, sequence parallel,
// pipeline), each degree dividing the world; TP alone with and without SP, PP alone, TP x PP.
struct Layout {
  int tensor;
  bool sequence_parallel;
  int pipeline;
};
std::vector<Layout> model_parallel_layouts(int world);

}  // namespace detail

// The plan table of `build`'s models on the session's ranks (see the design note). A layout whose
// plan the request cannot make (a global batch its data-parallel ranks do not split) or whose model
// the program cannot build (a std::invalid_argument before the measurement runs: a degree the model
// does not take) is listed as not built, with the reason. Collective.
template <class Dataset, class Build>
MemoryPlan plan_layouts(Session& session, const Dataset& dataset, const TrainConfig& cfg, Build& build) {
  const int world = session.pg.size();
  MemoryPlan plan;
  detail::RandomStateGuard rng(session.device);
  const Choice plain{world == 1 ? parallel::DataParallel::None : parallel::DataParallel::Replicate};
  detail::use_once(cfg, "", [&](auto&& use) { build(make_plan(cfg, plain, world, world), use); },
                   [&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions&) {
                     plan = plan_for(session, model, dataset, loss_fn, cfg, hooks);
                   });
  // One layout's plan made, its model built and `measure` run on it. A std::invalid_argument while
  // it is made or built (alike on every rank) lists it as not built; anything thrown once the
  // measurement ran (measure calls `running()` first: from there on inside collectives) goes on up.
  auto weigh = [&](const Choice& choice, auto&& measure) {
    Choice c = choice;
    c.recompute = c.recompute || cfg.activation_checkpointing;
    parallel::Plan named;  // (its name before it is made: a plan the request cannot make is listed by it)
    named.data = c.data;
    named.recompute = c.recompute;
    named.sequence_parallel = c.sequence_parallel;
    named.layout = {1, 1, c.pipeline, c.tensor};
    std::string name = named.name();
    bool running = false;
    try {
      const parallel::Plan p = make_plan(cfg, c, world, world);
      name = p.name();
      detail::use_once(cfg, " for " + name, [&](auto&& use) { build(p, use); },
                       [&](auto model, auto loss_fn, ModelHooks hooks, const FitOptions&) {
                         measure(p, model, loss_fn, std::move(hooks), [&running] { running = true; });
                       });
    } catch (const std::invalid_argument& e) {
      if (running) throw;
      plan.not_built.push_back(name + ": " + e.what());
    }
  };
  for (const detail::Layout& l : detail::model_parallel_layouts(world)) {
    const int d = world / (l.tensor * l.pipeline);
    const parallel::DataParallel around = d == 1 ? parallel::DataParallel::None : parallel::DataParallel::Replicate;
    if (l.pipeline == 1) {  // TP: measured under one kind (the groups are the same for all), counted for each
      weigh(Choice{around, false, l.tensor, l.sequence_parallel, 1},
            [&](const parallel::Plan& p, auto model, auto loss_fn, ModelHooks hooks, auto running) {
              running();
              const ModelFacts facts = measure_for(session, model, dataset, loss_fn, cfg, hooks);
              add_candidates(plan, tensor_parallel_candidates(cfg, world, p.layout.tensor, p.sequence_parallel, facts));
            });
      continue;
    }
    for (bool recompute : {false, true}) {  // PP (and TP x PP): built and tried, single or ddp around
      if (!recompute && cfg.activation_checkpointing) continue;
      const int64_t other = util::live_bytes(session.device);  // (the program's tensors: the data, ...)
      weigh(Choice{around, recompute, l.tensor, false, l.pipeline},
            [&](const parallel::Plan& p, auto model, auto loss_fn, ModelHooks hooks, auto running) {
              add_candidates(plan, {measure_pipeline(session, model, dataset, loss_fn, cfg, p, std::move(hooks), other, running)});
            });
    }
  }
  return plan;
}

}  // namespace dtrain::train
