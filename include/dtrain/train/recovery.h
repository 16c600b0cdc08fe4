#pragma once
// The library loop's side of in-process recovery (Design note [in-process recovery],
// train/elastic.h): what train::fit does between a failed step and the step it redoes. The loop
// (fit.h) calls them in this order: recoverable, regroup_session, make_plan at the new size (the
// global batch kept: train/plan.h), parallelize on the new group, then move_optimizer_state
// (replicated state) or held_for_regroup and load_from_peers (sharded state), Run::regroup, and
// Run::share_state where processes joined.
//
// Design note [sharded state in process]
// --------------------------------------
// ZeRO-1/2 and FSDP hold each rank's part of the optimizer state (and FSDP's of the parameters)
// nowhere else, so a lost rank's part lives on only in its partner snapshot (--snapshot-every,
// Design note [partner snapshots], checkpoint/partner_snapshot.h). After a failure the survivors
// roll back to the newest step whose snapshots they hold together (every survivor's own, and each
// lost rank's at its partner: with --snapshot-every 1 the last committed step, or the one before
// it when the exchange of the last was cut by the failure; the vote on a step waits for the
// exchange of the snapshot before it, so never older; with --snapshot-sync a step's record is
// written only once its snapshot's exchange ended everywhere, agreed by one all-reduce, so the
// step rolled back to is the last one recorded and only the step in flight is redone, at the
// price of the exchange no longer overlapping the next step), re-split that state over the new world
// from memory (Design note [state re-split from memory], checkpoint/peer_load.h) and redo the steps
// since (their records marked "redone"; the random streams go on, so dropout masks of redone steps
// differ from the first time's). Where processes only join, nothing is lost: the members
// offer copies of their live state, and the joiners receive their parts of it the same way, from
// the live ranks, never from the disk. Where a lost rank's partner was lost too, its state is gone
// from memory: the run ends with that reason, for dtrun --max-restarts to resume from --save's
// checkpoints.
#include <exception>
#include <string>

#include "dtrain/checkpoint/partner_snapshot.h"
#include "dtrain/checkpoint/peer_load.h"
#include "dtrain/parallel/plan.h"
#include "dtrain/train/config.h"
#include "dtrain/train/elastic.h"
#include "dtrain/train/session.h"
#include "dtrain/train/strategy.h"

namespace dtrain::train::detail {

// Whether in-process recovery handles `e`: a communication failure (CommError), or anything thrown
// once the session's group was aborted (a wait the watcher ended, an error of autograd around it).
bool recoverable(const std::exception& e, const Session& session);

// DTRAIN_ELASTIC_TRACE=1 (docs/elastic.md): this rank's wall-clock time at a point of a recovery,
// on stderr (to line up the ranks' and dtrun's views of one failure).
void trace(const Session& session, const std::string& what);

// Reports the failure `why` (unless another rank's report aborted this one; "": none, the job
// grows), agrees with the other members on the next generation (session.elastic) and puts its
// group in the session (rank and world size too). `next_step`: the steps this rank committed.
// Throws LeftOut when this rank was left out, or when no unit came whole (the change refused:
// Elastic::request_restart written).
void regroup_session(Session& session, const std::string& why, int64_t next_step);

// The optimizer state of `from` handed to `to`, a strategy over the same parameters whose state is
// replicated (stage 1: ddp): every survivor holds all of it. Throws naming what differs.
void move_optimizer_state(Strategy& from, Strategy& to);

// The program built its model on `model_groups` (ModelHooks::groups; a tensor-parallel model
// holds its tensor group in its layers and its loss). After a regroup that group is re-pointed at
// `fresh`'s tensor group of the same ranks (Design note [a group re-pointed],
// comm/process_group.h) and `fresh` takes the model's handle, so the strategy built on `fresh` and
// the model go on over one group; `elastic` keeps the state it replaced. Nothing without --tp.
void repoint_model_groups(const parallel::Groups& model_groups, parallel::Groups& fresh, Elastic& elastic);

// Whether each rank holds only its part of the state under `plan` (zero1, zero2, fsdp, hsdp,
// pipeline stages): it is re-split through checkpoint::load_from_peers (Design note [sharded state
// in process]).
bool state_sharded(const parallel::Plan& plan);
// Whether `plan`'s parts are held in whole units (hybrid sharding's shard groups, data-parallel
// replicas of a pipeline; Design note [whole units], train/elastic.h): a lost rank's part is in
// every other unit's memory, so the state is re-split from the live copies, never rolled back.
bool state_in_units(const parallel::Plan& plan);
// The units of `plan` for Elastic::set_units: tensor x pipeline x (hybrid sharding's) shard ranks
// (one rank each without those degrees). Where the state is sharded besides (zero1, zero2, fsdp
// around pipeline stages or tensor-parallel layers) the members still come in whole units, and the state rolls back to the partner
// snapshots, each rank's partner in another unit (snapshot_stride).
Units units_of(const parallel::Plan& plan);
// The partner snapshots' stride (Design note [partner snapshots]) under `plan`, `ranks_per_node`
// ranks a node: a partner in another unit where there are units (the next data-parallel index,
// `tensor` ranks on), else on another node where the world spans several.
int snapshot_stride(const parallel::Plan& plan, int world, int ranks_per_node);

// Collective over the session's (new) group, members and joiners alike, after parallelize on it:
// what this rank offers the re-split (Design note [sharded state in process]). `old`: the strategy
// this rank trained under as rank `old_rank` of `old_world`, `snapshots` its partner snapshots
// (nullptr: none taken), `committed` its committed steps (nullptr, nullptr, 0: a joining process).
// Where the old plan held its state in whole units (`place.copies`: the survivors' units hold a
// whole copy, at `committed` alike), those copies (taken once, before any load: a retry must not
// take them again from a half-loaded state); where every member regroups to let processes join
// (`grow`, a first attempt) and none was lost, copies of the members' live state at `committed`;
// else (a failure, or a retry: the live state may be half loaded) every survivor's newest snapshot
// of a step they all hold, and the lost ranks' copies. Throws naming a lost rank whose state no
// survivor holds.
struct OldPlace {
  int rank = -1, world = 0;
  const checkpoint::HeldState* copies = nullptr;  // (whole units: every element this rank held)
};
// Copies of every element of `old`'s state this rank holds (replicas too), at `committed`, written
// at `old_world`: what a rank of a whole unit offers (Design note [whole units], elastic.h).
checkpoint::HeldState held_copies(Strategy& old, int64_t committed, int old_world);
checkpoint::HeldState held_for_regroup(const Session& session, Strategy* old, checkpoint::PartnerSnapshots* snapshots,
                                       int64_t committed, bool grow = false, OldPlace place = {});

}  // namespace dtrain::train::detail
