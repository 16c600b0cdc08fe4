#pragma once
// The library loop's side of in-process recovery (Design note [in-process recovery],
// train/elastic.h): what train::fit does between a failed step and the step it redoes. The loop
// (fit.h) calls them in this order: recoverable, regroup_session, make_plan at the new size (the
// global batch kept: train/plan.h), parallelize on the new group, move_optimizer_state,
// Run::regroup, and Run::share_state where processes joined.
#include <exception>
#include <string>

#include "dtrain/parallel/plan.h"
#include "dtrain/train/config.h"
#include "dtrain/train/elastic.h"
#include "dtrain/train/session.h"
#include "dtrain/train/strategy.h"

namespace dtrain::train::detail {

// Whether in-process recovery handles `e`: a communication failure (CommError), or anything thrown
// once the session's group was aborted (a wait the watcher ended, an error of autograd around it).
bool recoverable(const std::exception& e, const Session& session);

// Reports the failure `why` (unless another rank's report aborted this one; "": none, the job
// grows), agrees with the other members on the next generation (session.elastic) and puts its
// group in the session (rank and world size too). `next_step`: the steps this rank committed.
// Throws when this rank was left out.
void regroup_session(Session& session, const std::string& why, int64_t next_step);

// The optimizer state of `from` handed to `to`, a strategy over the same parameters whose state is
// replicated (stage 1: ddp): every survivor holds all of it. Throws naming what differs.
void move_optimizer_state(Strategy& from, Strategy& to);

}  // namespace dtrain::train::detail
