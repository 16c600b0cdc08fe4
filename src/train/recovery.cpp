// Between a failed step and the step it redoes (train/recovery.h, Design note [in-process recovery]).
#include "dtrain/train/recovery.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>

#include <ATen/ATen.h>

#include <torch/optim/optimizer.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/types.h"
#include "dtrain/train/plan.h"
#include "state/optimizer_part.h"

namespace dtrain::train::detail {

bool recoverable(const std::exception& e, const Session& session) {
  if (dynamic_cast<const LeftOut*>(&e)) return false;  // (the others went on without this rank)
  if (dynamic_cast<const comm::FatalError*>(&e)) return false;  // (its peers' waits end when this process does)
  return dynamic_cast<const comm::CommError*>(&e) != nullptr || session.pg.abort_signal()->aborted();
}

void regroup_session(Session& session, const std::string& why, int64_t next_step) {
  if (!why.empty() && !session.pg.abort_signal()->aborted()) session.elastic->report_failure(why);
  session.pg = session.elastic->regroup(next_step);
  session.launch.rank = session.pg.rank();
  session.launch.world_size = session.pg.size();
}

void move_optimizer_state(Strategy& from, Strategy& to) {
  TORCH_CHECK(!from.optimizer_part().is_sharded() && !to.optimizer_part().is_sharded(),
              "--elastic: the optimizer state is sharded (ZeRO): a lost rank's part is not on the survivors");
  torch::optim::Optimizer& a = from.optimizer();
  torch::optim::Optimizer& b = to.optimizer();
  TORCH_CHECK(a.param_groups().size() == b.param_groups().size(), "--elastic: the rebuilt optimizer has ",
              b.param_groups().size(), " parameter groups, ", a.param_groups().size(), " before");
  for (size_t g = 0; g < a.param_groups().size(); ++g) {
    const auto& pa = a.param_groups()[g].params();
    const auto& pb = b.param_groups()[g].params();
    TORCH_CHECK(pa.size() == pb.size(), "--elastic: parameter group ", g, " has ", pb.size(), " parameters, ", pa.size(),
                " before");
    for (size_t i = 0; i < pa.size(); ++i) {
      TORCH_CHECK(pa[i].is_same(pb[i]), "--elastic: parameter ", i, " of group ", g,
                  " is another tensor after regrouping (the model's parameters must stay the same tensors)");
    }
  }
  std::swap(a.state(), b.state());
}

void repoint_model_groups(const parallel::Groups& model_groups, parallel::Groups& fresh, Elastic& elastic) {
  if (model_groups.layout.tensor < 2) return;
  TORCH_CHECK(fresh.layout.tensor == model_groups.layout.tensor, fresh.world.describe(), " --elastic: the model was "
              "built on a tensor group of ", model_groups.layout.tensor, " ranks and the new plan's has ", fresh.layout.tensor);
  comm::ProcessGroup held = model_groups.tensor;  // (a copy of the handle: its state is every copy's)
  elastic.retire(held.repoint(fresh.tensor));
  fresh.tensor = held;
}

bool state_sharded(const parallel::Plan& plan) {
  using parallel::DataParallel;
  return plan.data == DataParallel::ShardOptimizer || plan.data == DataParallel::ShardGradients ||
         plan.data == DataParallel::FullShard || plan.layout.pipeline > 1 || plan.layout.tensor > 1;
}

bool state_in_units(const parallel::Plan& plan) {
  using parallel::DataParallel;
  const bool hybrid = plan.data == DataParallel::FullShard && plan.fsdp.sharding == parallel::Sharding::Hybrid;
  const bool replicated = plan.data == DataParallel::Replicate || plan.data == DataParallel::None;
  return hybrid || (replicated && (plan.layout.pipeline > 1 || plan.layout.tensor > 1));
}

Units units_of(const parallel::Plan& plan) {
  const bool hybrid = plan.data == parallel::DataParallel::FullShard && plan.fsdp.sharding == parallel::Sharding::Hybrid;
  // (zero1, zero2 and fsdp around pipeline stages or tensor-parallel layers: a pipeline replica or
  // a tensor group is a unit, its state from the partner snapshots, a partner in another unit:
  // Design note [whole units], elastic.h)
  return {plan.layout.tensor, plan.layout.pipeline, hybrid ? plan.layout.shard : 1};
}

int snapshot_stride(const parallel::Plan& plan, int world, int ranks_per_node) {
  const bool nodes = ranks_per_node < world && world % ranks_per_node == 0;
  const Units u = units_of(plan);
  if (u.size() == 1) return nodes ? ranks_per_node : 1;
  // (units: rank + T is the next data-parallel index, in another unit; a node away too where that
  // also lands in another unit, i.e. moves the data-parallel index by a number D does not divide)
  const int d = world / (u.tensor * u.pipeline);
  if (nodes && ranks_per_node % u.tensor == 0 && (ranks_per_node / u.tensor) % d != 0) return ranks_per_node;
  return u.tensor;
}

namespace {

// One rank's row of held_for_regroup's all-gather.
enum Column { kOldRank, kOldWorld, kCommitted, kHasSnapshots, kGrow, kStep0, kStep1, kColumns };

// What the members' rows say: the old ranks still here, the old world's size, the newest step
// whose snapshots every member holds (-1: none), and whether all have snapshots and all grow.
struct Survey {
  std::set<int64_t> present;
  int64_t old_world = 0, newest_common = -1;
  bool all_snapshots = true, all_grow = true;
};

Survey survey(const int64_t* rows, int n) {
  Survey s;
  std::map<int64_t, int> holders;  // step -> members holding its snapshots
  int members = 0;
  for (int r = 0; r < n; ++r) {
    const int64_t* x = rows + r * kColumns;
    if (x[kCommitted] < 0) continue;  // (a joining process)
    ++members;
    s.present.insert(x[kOldRank]);
    s.old_world = std::max(s.old_world, x[kOldWorld]);
    s.all_snapshots = s.all_snapshots && x[kHasSnapshots] == 1;
    s.all_grow = s.all_grow && x[kGrow] == 1;
    for (int c = kStep0; c <= kStep1; ++c) {
      if (x[c] >= 0) ++holders[x[c]];
    }
  }
  for (const auto& [step, count] : holders) {
    if (count == members) s.newest_common = step;  // (ascending: the last is the newest)
  }
  return s;
}

// `scope` Held: every element this rank holds (Design note [whole units], elastic.h).
checkpoint::HeldState live_copies(Strategy& old, int64_t committed, int old_world, Strategy::Scope scope) {
  checkpoint::Snapshot snap = old.state_snapshot(scope);
  checkpoint::HeldState held{committed, old_world, snap.metadata, {}};
  for (checkpoint::Piece p : snap.pieces) {
    p.data = p.data.detach().cpu().clone(at::MemoryFormat::Contiguous);  // (the live tensors are reloaded)
    held.pieces.push_back(std::move(p));
  }
  return held;
}

}  // namespace

void trace(const Session& session, const std::string& what) {
  static const bool on = std::getenv("DTRAIN_ELASTIC_TRACE") != nullptr;
  if (!on) return;
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::fprintf(stderr, "elastic trace rank %d (of %d) %.3f: %s\n", session.pg.rank(), session.pg.size(), now, what.c_str());
  std::fflush(stderr);
}

checkpoint::HeldState held_copies(Strategy& old, int64_t committed, int old_world) {
  return live_copies(old, committed, old_world, Strategy::Scope::Held);
}

checkpoint::HeldState held_for_regroup(const Session& session, Strategy* old, checkpoint::PartnerSnapshots* snapshots,
                                       int64_t committed, bool grow, OldPlace place) {
  const comm::ProcessGroup& pg = session.pg;
  if (snapshots) {
    try {
      snapshots->wait();  // (an exchange the failure cut ends aborted: the pair before stays)
    } catch (const std::exception&) {
    }
  }
  std::vector<int64_t> row(kColumns, -1);
  if (old) {
    row[kOldRank] = snapshots ? snapshots->rank() : place.rank;
    row[kOldWorld] = snapshots ? snapshots->size() : place.world;
    row[kCommitted] = committed;
    row[kHasSnapshots] = snapshots ? 1 : 0;
    row[kGrow] = grow ? 1 : 0;
    const std::vector<int64_t> steps = snapshots ? snapshots->steps() : std::vector<int64_t>{};
    for (size_t i = 0; i < steps.size() && i < 2; ++i) row[kStep0 + i] = steps[i];
  }
  at::Tensor all = at::empty({pg.size() * kColumns}, at::kLong);
  comm::all_gather(pg, all, at::tensor(row, at::kLong));
  const Survey s = survey(all.data_ptr<int64_t>(), pg.size());
  if (!old) return {};
  const int old_world = static_cast<int>(s.old_world);
  if (place.copies) return *place.copies;  // (Design note [whole units], elastic.h)
  TORCH_CHECK(s.all_snapshots, pg.describe(), " --elastic: the state is sharded and a rank ran without "
              "--snapshot-every: a lost rank's part would be nowhere (a bug: the request is checked)");
  std::vector<int> lost;
  for (int r = 0; r < s.old_world; ++r) {
    if (!s.present.count(r)) lost.push_back(r);
  }
  if (lost.empty() && s.all_grow) return live_copies(*old, committed, old_world, Strategy::Scope::Written);
  for (int r : lost) {
    const int keeper = snapshots->keeper_of(r);
    TORCH_CHECK(s.present.count(keeper), pg.describe(), " --elastic: rank ", r, "'s part of the state was held by rank ",
                keeper, " (its partner snapshot), which is lost too: it is gone from memory; resume from --save's "
                "checkpoints (dtrun --max-restarts with --resume)");
  }
  TORCH_CHECK(s.newest_common >= 0, pg.describe(), " --elastic: the survivors hold no partner snapshot of one step (a rank "
              "was lost before the first --snapshot-every snapshot completed): resume from --save's checkpoints");
  const int64_t step = s.newest_common;
  const checkpoint::HeldSnapshot* mine = snapshots->mine_of(step);
  checkpoint::HeldState held{step, old_world, mine->metadata, mine->pieces};
  const int kept_for = snapshots->holding_for();
  if (kept_for != snapshots->rank() && std::find(lost.begin(), lost.end(), kept_for) != lost.end()) {
    const checkpoint::HeldSnapshot* theirs = snapshots->held_of(step);
    held.pieces.insert(held.pieces.end(), theirs->pieces.begin(), theirs->pieces.end());
  }
  return held;
}

}  // namespace dtrain::train::detail
