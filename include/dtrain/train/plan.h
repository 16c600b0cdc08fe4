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
// Step t trains positions [t x G, (t+1) x G) of the epoch's order (an epoch: floor(N / G) steps),
// dealt round-robin: data-parallel rank r takes positions r, r + D, ... of the step's, in runs of
// --batch-size (what DistributedSampler gives each rank where D divides G).
// Uneven (--elastic, where D does not divide G: a world the job shrank or grew to): rank r takes
// ceil((G - r) / D) samples, every rank accumulates the same a = ceil(ceil(G / D) / --batch-size)
// micro-batches of at most ceil(ceil(G / D) / a), and micro-batch m's mean loss is weighted by its
// n samples as n x D / G (even: 1 / a), so the data-parallel average of the gradients is the
// global batch's mean as one process computes it. A rank with fewer samples than micro-batches
// runs its first sample again with weight 0 (every rank's backward reaches the same reductions).
#include <string>
#include <vector>

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

// Data-parallel rank `rank` of `data_parallel`'s micro-batch m of one step: the half-open range of
// its k-th samples (k counts the step's positions rank, rank + D, ...; empty where it has fewer),
// and the weight of that micro-batch's mean loss (n x D / G as a divisor G / (n x D): exactly the
// accumulation where the split is even; 0 for an empty one). Design note [the global batch].
struct MicroBatchShare {
  int64_t begin = 0, end = 0;  // k in [begin, end)
  double divisor = 1;          // the mean loss / divisor; 0: weight 0 (empty)
  // The positions in the epoch's order of a global batch starting at `first`: first + rank + k x D
  // for k in [begin, end); where empty, the rank's first position again (run with weight 0).
  std::vector<int64_t> positions(int64_t first, int rank, int data_parallel) const;
};
MicroBatchShare micro_batch_share(const parallel::Batch& batch, int data_parallel, int rank, int64_t m);

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
