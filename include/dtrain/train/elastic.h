#pragma once
// In-process recovery (issue 30, stage 1): the survivors of a lost rank drop the step in flight,
// agree on who is left, make a fresh process group over themselves and go on from the state they
// hold, without restarting a process or reading a checkpoint.
//
// Design note [in-process recovery]
// ---------------------------------
// Every step is a transaction. A rank's part of step t ends with the step's report all-gather;
// then it votes through the job's store (`commit`): it adds 1 to elastic/g<G>/s<t>/ok and waits
// until either every member of generation G added (the first to see it writes "commit" into the
// step's decision key with compareSet) or a failure was reported (it writes "abort"). Whichever
// write came first is the decision every rank reads, so all ranks step the optimizer or none does,
// even where a collective completed on some ranks and not on others (a rank that dies between its
// sends). The optimizer steps only after a commit: an aborted step leaves the parameters and the
// optimizer state as they were before it, on every survivor.
//
// A failure is counted in elastic/failures: by the rank whose collective failed (its exception),
// by dtrun --keep-survivors for a worker that died (with elastic/dead/<id>), and it is watched by
// a thread on every rank (every 50 ms) that raises the group's AbortSignal (Design note [aborting
// a group's waits], comm/abort.h), so no rank waits out the collective timeout for a peer that
// will never answer. Generation G's members all count failures from the same baseline (the count
// when G was decided, written with its members). The watcher also aborts once any member started
// regrouping (elastic/g<G+1>/started): a member that went on proves the step cannot complete, even
// where the count did not reach a rank in time (the soak benchmark found such a survivor, waiting
// in an all-reduce for a dead peer while the others waited for it in the regroup).
//
// After a failure each survivor registers for generation G+1 (elastic/g<G+1>/join/<id>, the step
// it will redo) and waits until every member of G joined or was declared dead, or
// --elastic-join-timeout passed; the first to get there writes the members (compareSet: one
// decision). The members are the survivors in their old order, then the joiners taken in (in whole
// units of the plan where a rank holds part of one copy: Design note [whole units]), renumbered
// densely in that order; every one must redo the same step (else the recovery fails, naming the
// ranks). The new group is a Gloo group over elastic/g<G+1>/ of the same store. The old group is
// never destroyed (its Gloo threads may still wait for the dead peer until their timeout, and
// ~ProcessGroupGloo would wait with them): it stays alive, unused, until the process exits.
//
// A process that joins (dtrun --keep-survivors --max-restarts: a replacement for a lost rank, with
// DTRAIN_ELASTIC_JOIN=1 and a rank the job never had as its id) registers as elastic/joiner/<n>
// (n from the elastic/joiners count) and waits. The rank that writes a step's decision writes the
// joiner count with it ("commit:<n>"), so every member sees the same count: when it is above the
// one the current generation was decided with, every member finishes that step and regroups, and
// the decider of the next generation takes in every joiner registered by then (except one declared
// dead) and writes elastic/latest, which joiners watch. A joiner receives everything from the live
// ranks (Run::share_state: the step, the optimizer state, the learning-rate base; the parameters come
// with DDP's broadcast when it is built), never from disk.
//
// What the loop then rebuilds is the plan at the new world size with the same global batch
// (Design note [the global batch], train/plan.h: the same samples at every step, so the run goes
// on as the uninterrupted run would), the data-parallel wrapper on the new group, and the
// optimizer, which takes the replicated state every survivor holds (stage 1: --strategy ddp).
// A survivor left out (it joined after the decision, or its unit lost a member: Design note [whole
// units] below) marks itself dead and exits with the reason. Where the survivors cannot go on at
// all (no whole unit left; the plan does not fit the new world, or the memory budget) the change is
// refused: each writes elastic/restart with the reason and ends, and dtrun --keep-survivors, seeing
// it at the worker's exit, fails the round as a restartable failure (--max-restarts: every worker
// starts again from the newest checkpoint, over the nodes still there) instead of one more rank
// lost on the way.
#include <chrono>
#include <condition_variable>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <torch/arg.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::train {

// Thrown by Elastic::join when the run ended before the joining process was taken in: nothing to
// do (run_reporting_errors, train/session.h, prints it and returns 0).
struct RunEnded : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Thrown by Elastic::regroup on a rank the others went on without (it joined too late, or its unit
// broke), or on every survivor when no unit came whole (the change refused, elastic/restart
// written): never recovered from (train/recovery.h); the process ends with the reason.
struct LeftOut : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ElasticOptions {
  // How long survivors wait for a member of the last generation that neither joined the next nor
  // was declared dead (a rank hung, or cut off) before they go on without it.
  TORCH_ARG(std::chrono::milliseconds, join_timeout) = std::chrono::seconds(30);
  // How often each rank's watcher looks for a reported failure.
  TORCH_ARG(std::chrono::milliseconds, watch_interval) = std::chrono::milliseconds(50);
};

// Design note [whole units]
// -------------------------
// Under some plans a rank holds only its part of one copy of the state, and the copies are
// replicated: HSDP's shard group of S ranks holds one copy, and every shard group holds the same;
// each data-parallel replica of a pipeline (P stages) holds one copy. Such a group of ranks is a
// unit (tensor x pipeline x shard ranks; Units). A unit that lost a member no longer holds a whole
// copy, and its survivors cannot fill a unit of the smaller world (the degrees must divide it), so
// the members of each generation come in whole units: a unit that lost a rank leaves with it (its
// survivors are left out, mark themselves dead so that dtrun counts no failure, and end: dtrun
// --max-restarts starts processes in their places), and processes that join are taken in only U at
// a time (the others wait for their unit to fill). The members keep their places: ordered by
// (stage, unit, shard rank, tensor rank), survivors' units first in their old order, so each
// survivor keeps its stage and shard rank and the layout's rank formula (parallel/layout.h) holds.
// The state is re-split from the live copies the surviving units hold (checkpoint::load_from_peers,
// Design note [sharded state in process], train/recovery.h): nothing is rolled back, and no
// partner snapshot is needed. (torchft's replica groups are lost whole alike.) Where the state is
// sharded across the units besides (zero1, zero2 and fsdp around pipeline stages or tensor-parallel
// layers: a stage's or a tensor piece's optimizer state, or its parameters too, split over its
// data-parallel ranks), the members still come in whole units (the degrees must divide the world),
// but no unit holds a whole copy:
// each rank's partner snapshot is kept by a rank of another unit (train::snapshot_stride), and the
// state rolls back to the snapshots as without units.
struct Units {
  int tensor = 1, pipeline = 1, shard = 1;
  int size() const { return tensor * pipeline * shard; }
};

// One generation's membership as decided.
struct Membership {
  int generation = 0;
  std::vector<int> ids;  // the members' ids, by their rank in this generation
  int64_t baseline = 0;  // elastic/failures when it was decided
  int64_t joiners = 0;   // elastic/joiners when it was decided (those registered are in, or dead)
  std::vector<int> newcomers;  // ids in this generation that were in none before (joiners)
};

// A process registered to join: its slot in elastic/joiner/<slot>, its id, whether it was declared dead.
struct JoinerSlot {
  int64_t slot = 0;
  int id = 0;
  bool dead = false;
};

// The next generation's members (Design note [whole units]): `current`'s survivors (ids) whose unit
// is whole, in their places, then the joiners of `slots` (in order, after current.joiners) taken
// in whole units (none when no survivor's unit is whole: a generation of joiners alone would hold
// none of the trained state); joiners counts the slots passed (taken, or dead). Baseline: current's.
Membership choose_members(const Membership& current, const std::vector<int>& survivors,
                          const std::vector<JoinerSlot>& slots, const Units& units);

// "0,1,3" (`sep` between ids): a membership's ids as the store, the messages and the metrics write them.
std::string join_ids(const std::vector<int>& ids, const char* sep = ",");

class Elastic {
 public:
  // Generation 0 over `world` (every rank, collective only in the sense that all must call it):
  // arms the world's abort signal and starts the watcher. A rank's id is its rank in `world`.
  Elastic(comm::ProcessGroup world, ElasticOptions options = {});
  // A process joining a running job as `id` over `store` (the job's, as comm::job_store gives it):
  // registers and waits (up to `timeout`) until the members take it in; then as above.
  static std::unique_ptr<Elastic> join(c10::intrusive_ptr<c10d::Store> store, int id, comm::BackendKind kind,
                                       std::chrono::milliseconds timeout, c10::Device device, ElasticOptions options = {});
  ~Elastic();
  Elastic(const Elastic&) = delete;
  Elastic& operator=(const Elastic&) = delete;

  int id() const { return id_; }
  const Membership& membership() const { return members_; }
  // The current generation's group.
  const comm::ProcessGroup& group() const { return group_; }

  // The vote on step `step` (1-based), after this rank's part of it succeeded: true when every
  // member's did (commit), false when the step is dropped (a failure was reported first).
  bool commit(int64_t step);
  // A committed step's decision said that processes wait to join: regroup after it.
  bool grow_due() const { return grow_due_; }
  // This process joined the current generation (it needs the live ranks' state: Run::share_state).
  bool newcomer() const;
  // The members trained the last step: processes still waiting to join end (RunEnded).
  void finish();
  // Reports a failure this rank saw (counted once per call); the other ranks' waits abort.
  void report_failure(const std::string& why);
  // The survivors cannot go on in process (no whole unit left, a plan that does not fit the new
  // world): asks dtrun --keep-survivors, through elastic/restart, to fail the round as a restartable
  // failure instead of counting this process lost, so that --max-restarts restarts every worker
  // from the newest checkpoint (Design note [in-process recovery], "refused"). Call before the
  // process ends with the error.
  void request_restart(const std::string& why);
  // The plan's units (Design note [whole units]); every member sets the same before its first step.
  void set_units(Units units) {
    std::lock_guard<std::mutex> lock(mu_);
    units_ = units;
  }
  const Units& units() const { return units_; }
  // Keeps `g` (a group of an old generation, e.g. the partner snapshots') from being destroyed:
  // Design note [aborting a group's waits].
  void retire(const comm::ProcessGroup& g) { retired_.push_back(g); }
  // After a failure: agrees with the survivors on the next generation and returns its group (this
  // rank's place in it). `next_step`: the step this rank will redo (0-based, the committed count).
  // Throws std::runtime_error when this rank was left out or the survivors disagree on the step.
  comm::ProcessGroup regroup(int64_t next_step);

 private:
  std::string key(int generation, const std::string& what) const;
  Elastic(c10::intrusive_ptr<c10d::Store> store, int id, comm::BackendKind kind, std::chrono::milliseconds timeout,
          c10::Device device, ElasticOptions options);
  Membership decide(int generation);
  // The members of `generation` from the survivors (ids) and the joiners: Design note [whole units].
  Membership choose(int generation, const std::vector<int>& survivors);
  // The ids of this rank's unit mates declared dead ("": none, or units of one rank).
  std::string lost_unit_mates() const;
  // Processes registered to join since this generation was decided, alive (not declared dead).
  int64_t joiners_waiting() const;
  comm::ProcessGroup make_group(const Membership& m);  // this rank's group in `m` (becomes current)
  void watch();

  c10::intrusive_ptr<c10d::Store> store_;  // the job's store the world group was made over
  comm::BackendKind kind_;
  std::chrono::milliseconds timeout_;
  c10::Device device_;
  ElasticOptions options_;
  int id_ = 0;
  Membership members_;
  int last_generation_ = 0;  // the newest generation this rank tried to join
  Units units_;
  std::atomic<bool> grow_due_{false};  // (read by the watcher: a planned grow is no reason to abort)
  comm::ProcessGroup group_;
  std::vector<comm::ProcessGroup> retired_;  // never destroyed (see the design note)
  // The watcher: raises group_'s abort signal when elastic/failures passes the baseline.
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread watcher_;
};

}  // namespace dtrain::train
