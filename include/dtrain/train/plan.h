#pragma once
// The request parsed into the plan it names: make_plan(cfg, world, local_world_size) reads the
// strategy's name and its options off a TrainConfig once, resolves their defaults (the layout of
// the degrees, FSDP's sharding, the pipeline's schedule and micro-batches, loss scaling, the split
// of the global batch) and validates the result (parallel::Plan::validate: the one place that
// decides what combines). The request is never changed into the plan: each stays what it is.
//
// Design note [the global batch]
// A run trains the same samples per optimizer step whatever the plan: the global batch G is
// --global-batch-size, or the request's ranks x --batch-size x --grad-accum. A plan splits it into
// its data-parallel ranks D (the world size over tensor x pipeline degrees) x micro-batches of
// --batch-size samples x accumulation steps: accumulation = G / (D x batch-size), an error naming
// the sizes where that is not a whole number. So a layout the planner picks (or a user names)
// with fewer data-parallel ranks accumulates more micro-batches instead of training a smaller
// batch, matches one process at the batch asked for, and its checkpoints resume under any other.
#include <string>

#include <c10/core/ScalarType.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/parallel/plan.h"
#include "dtrain/train/config.h"
#include "dtrain/train/session.h"

namespace dtrain::train {

// A plan the memory planner weighs: the kind, recomputation and degrees it tries, with the
// request's other options (FSDP's, the pipeline's, precision, the global batch).
struct Choice {
  parallel::DataParallel data = parallel::DataParallel::Replicate;
  bool recompute = false;
  int tensor = 1;
  bool sequence_parallel = false;
  int pipeline = 1;
};

// The plan cfg names on `world` ranks (`local_world_size` per node: hybrid sharding's default
// shard group). Throws std::invalid_argument naming the flags and the reason; cfg.strategy must not
// be auto (the memory planner resolves that, train/planner.h).
parallel::Plan make_plan(const TrainConfig& cfg, int world, int local_world_size);
// make_plan with LOCAL_WORLD_SIZE from the environment (as dtrun, torchrun and srun set it; the
// world size when unset).
parallel::Plan make_plan(const TrainConfig& cfg, int world);
// On the session's ranks (its LOCAL_WORLD_SIZE).
parallel::Plan make_plan(const TrainConfig& cfg, const Session& session);
// The plan `choice` names with cfg's other options (the memory planner's candidates).
parallel::Plan make_plan(const TrainConfig& cfg, const Choice& choice, int world, int local_world_size);
// The data-parallel kind a strategy name means; throws naming --strategy (auto has none).
parallel::DataParallel parse_data_parallel(const std::string& strategy);
// The split of cfg's global batch over `data_parallel` ranks (Design note [the global batch]).
parallel::Batch split_batch(const TrainConfig& cfg, int world, int data_parallel);

// The plan's layout and its process groups on pg's ranks (collective: every rank calls it), for a
// program that builds its model on them (e.g. --tp: the model is built on groups.tensor).
parallel::Groups make_groups(const parallel::Plan& plan, const comm::ProcessGroup& pg);
parallel::Groups make_groups(const TrainConfig& cfg, const comm::ProcessGroup& pg);

// The dtype of the forward's autocast region and of FSDP's gathered parameters.
at::ScalarType compute_dtype(parallel::Precision precision);
inline at::ScalarType compute_dtype(const parallel::Plan& plan) { return compute_dtype(plan.precision); }
// The request's --precision.
parallel::Precision precision_of(const TrainConfig& cfg);

}  // namespace dtrain::train
