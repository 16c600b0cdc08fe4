// The agent's rendezvous: every node of a fixed count, or the elastic membership of --nnodes
// MIN:MAX (Design note [elastic membership], dtrain/launch/agent.h).
#include <algorithm>

#include "agent_internal.h"
#include "dtrain/launch/workers.h"

namespace dtrain::launch {

void Agent::begin_round() {
  failure_ = RoundFailure{};
  failed_.clear();  // (--keep-survivors: the round's own)
  left_code_ = 0;
  replaced_in_round_ = 0;
}

void Agent::rendezvous() {
  const auto deadline = Clock::now() + ms(options_.rdzv_timeout_s);
  begin_round();
  if (coordinates() && options_.elastic()) {
    elastic_rendezvous();
    return;
  }
  if (!coordinates()) {  // one node: nobody to meet (the workers meet in the store themselves)
    start_workers();
    state_ = AgentState::kRunning;
    return;
  }
  AgentStore* store = store_.get();
  const int round = round_;
  const auto hb = ms(options_.heartbeat_timeout_s);
  struct Joining {
    std::optional<RoundFailure> failure;
    bool all = false;
    std::vector<int> stale, missing;
  };
  try {
    auto joined = calls_->submit([store, round] { store->join(round); return true; });
    for (;;) {
      int sig = 0;
      if (take_stop_signal(&sig)) return stop_in_rendezvous(sig);
      if (joined.valid() && !await(std::move(joined))) continue;  // a stop signal: taken above
      auto seen = await(calls_->submit([store, round, hb] {
        Joining j;
        j.failure = store->failure(round);
        if (j.failure) return j;
        j.all = store->all_joined(round);
        if (j.all) return j;
        j.stale = store->heartbeat(hb);
        j.missing = store->missing_nodes(round);
        return j;
      }));
      if (!seen) continue;
      if (auto f = seen->failure) return failed_before_start(*f);
      if (seen->all) break;
      const auto& stale = seen->stale;
      if (!stale.empty() || Clock::now() >= deadline) {
        const auto& missing = seen->missing;
        std::ostringstream s;
        s << "rendezvous " << (stale.empty() ? "timed out after " + seconds_text(options_.rdzv_timeout_s)
                                             : "failed: the dtrun of node(s) " + list(stale) + " stopped responding")
          << ": " << options_.nnodes - static_cast<int>(missing.size()) << " of " << options_.nnodes
          << " nodes joined" << (round_ > 0 ? " for restart " + std::to_string(round_) : "")
          << " (missing node ranks: " << list(missing) << ")";
        throw LaunchError(s.str());
      }
      wait_events(options_.monitor_interval_s);
    }
  } catch (const LaunchError&) {
    throw;
  } catch (const std::exception& e) {
    return end_on_lost_store(e);
  }
  start_workers();
  state_ = AgentState::kRunning;
}

namespace {
bool has(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }
bool has_string(const std::vector<std::string>& v, const std::string& x) { return std::find(v.begin(), v.end(), x) != v.end(); }
}  // namespace

// What one look at the store during an elastic rendezvous saw.
struct Agent::ElasticSeen {
  std::optional<RoundFailure> failure;
  std::optional<std::vector<int>> members;  // once node 0 closed the round
  std::optional<std::pair<int, std::vector<int>>> admitted;  // (--keep-survivors) into the running round
  int restarts = 0;                         // the restarts the job had used when node 0 closed it
  int joined = 0;                           // (node 0, before it closed the round)
};

void Agent::elastic_rendezvous() {
  const auto t0 = Clock::now();
  AgentStore* store = store_.get();
  try {
    if (!started_) {  // a node starting late joins the round after the newest closed one
      if (options_.node_rank == 0) await(calls_->submit([store] { store->publish_settings(); return true; }));
      check_settings();
      const auto newest = await(calls_->submit([store] { return store->newest_round(); }));
      if (!newest) return stop_in_rendezvous();
      if (*newest) round_ = **newest + 1;
      started_ = true;
    }
    if (!elastic_join()) return;
  } catch (const LaunchError&) {
    throw;
  } catch (const std::exception& e) {
    return end_on_lost_store(e);
  }
  if (options_.coordinator()) {  // Design note [a coordinator node]
    output_.log("round " + std::to_string(round_) + ": node(s) " + list(members_) + " (" + std::to_string(members_.size()) +
                " of " + std::to_string(options_.min_nodes) + ".." + std::to_string(options_.nnodes) + ", decided in " +
                seconds_text(std::round(std::chrono::duration<double>(Clock::now() - t0).count() * 10) / 10) + "): ranks 0-" +
                std::to_string(static_cast<int>(members_.size()) * workers_per_node() - 1) + "; this node coordinates");
    state_ = AgentState::kCoordinating;
    return;
  }
  if (!admitted_ids_.empty()) {
    output_.log("admitted into the running round " + std::to_string(round_) + " (node(s) " + list(members_) +
                ") in process: " + std::to_string(admitted_ids_.size()) + " worker(s) join it at its next step");
    start_workers();
    state_ = AgentState::kRunning;
    return;
  }
  output_.log("round " + std::to_string(round_) + ": node(s) " + list(members_) + " (" +
              std::to_string(members_.size()) + " of " + std::to_string(options_.min_nodes) + ".." +
              std::to_string(options_.nnodes) + ", decided in " +
              seconds_text(std::round(std::chrono::duration<double>(Clock::now() - t0).count() * 10) / 10) + "): " +
              ranks_here() + " of " +
              std::to_string(static_cast<int>(members_.size()) * options_.nproc_per_node) + " on this node");
  start_workers();
  state_ = AgentState::kRunning;
}

// Throws LaunchError when node 0 runs with other settings than this node (its published ones).
void Agent::check_settings() {
  if (options_.node_rank == 0) return;
  AgentStore* store = store_.get();
  const auto mismatch = await(calls_->submit([store] { return store->settings_mismatch(); }));
  if (mismatch && *mismatch) throw LaunchError(**mismatch);
}

// Joins round_ (the next one when node 0 closed it without this node) until a round this node is a
// member of is closed; false when a stop signal or an earlier failure ended the rendezvous.
bool Agent::elastic_join() {
  AgentStore* store = store_.get();
  auto deadline = Clock::now() + ms(options_.rdzv_timeout_s);
  std::optional<Clock::time_point> quorum_at;  // node 0: when MIN nodes had joined
  admitted_ids_.clear();
  int round = round_;
  const bool coordinator = options_.coordinator();  // (which closes rounds without joining them)
  auto joined = coordinator ? std::future<bool>() : calls_->submit([store, round] { store->join(round); return true; });
  for (;;) {
    int sig = 0;
    if (take_stop_signal(&sig)) return stop_in_rendezvous(sig), false;
    if (joined.valid() && !await(std::move(joined))) continue;  // a stop signal: taken above
    auto seen = await(calls_->submit([store, round, closer = options_.node_rank == 0, keep = options_.keep_survivors] {
      ElasticSeen s;
      s.failure = store->failure(round);
      s.members = store->members(round);
      if (keep && !s.members && !closer) s.admitted = store->admission(round);
      if (s.members) s.restarts = store->restarts_of(round);
      if (!s.members && closer) s.joined = store->joined_count(round);
      return s;
    }));
    if (!seen) continue;
    if (coordinator && seen->failure) return failed_before_start(*seen->failure), false;
    if (coordinator && seen->members) return become_member(*seen->members, seen->restarts), true;
    const bool member = seen->members && has(*seen->members, options_.node_rank);
    if (seen->members && !member && (!seen->failure || seen->failure->restartable)) {
      // A round without this node (it came as node 0 closed it, or it was dropped): the next one.
      check_settings();
      output_.log("round " + std::to_string(round) + " runs without this node; joining the next one");
      round = ++round_;
      joined = calls_->submit([store, round] { store->join(round); return true; });
      deadline = Clock::now() + ms(options_.rdzv_timeout_s);
      continue;
    }
    if (auto f = seen->failure) return failed_before_start(*f), false;
    if (member) return become_member(*seen->members, seen->restarts), true;
    if (seen->admitted) return join_running_round(*seen->admitted), true;
    if (options_.node_rank == 0) close_when_due(round, seen->joined, quorum_at);
    if (Clock::now() >= deadline) {
      throw LaunchError("rendezvous timed out after " + seconds_text(options_.rdzv_timeout_s) + ": " +
                        (options_.node_rank == 0 ? std::to_string(seen->joined) + " node(s) joined round "
                                                 : std::string("node 0 did not start round ")) +
                        std::to_string(round) + ", and --nnodes " + std::to_string(options_.min_nodes) + ":" +
                        std::to_string(options_.nnodes) + " needs at least " + std::to_string(options_.min_nodes));
    }
    wait_events(options_.monitor_interval_s);
  }
}

void Agent::become_member(const std::vector<int>& members, int restarts) {
  members_ = members;
  lost_nodes_.clear();  // (the round's own bookkeeping: --keep-survivors, agent_survivors.cpp)
  joined_in_process_.clear();
  restarts_used_ = std::max(restarts_used_, restarts);  // (a node that joined late counts the job's)
  was_member_ = true;
  AgentStore* store = store_.get();
  await(calls_->submit([store, members] { store->watch(members); return true; }));
}

// Node 0: closes `round` once MAX nodes joined, or MIN had and --rdzv-last-call passed since.
void Agent::close_when_due(int round, int joined, std::optional<Clock::time_point>& quorum_at) {
  if (joined < options_.min_nodes) return;
  if (!quorum_at) quorum_at = Clock::now();
  if (joined < options_.nnodes && Clock::now() - *quorum_at < ms(options_.rdzv_last_call_s)) return;
  AgentStore* store = store_.get();
  // (only nodes of the same settings are members, and MIN of them: a round never closes emptier)
  const auto left_out = await(calls_->submit([store, round, restarts = restarts_used_, min = options_.min_nodes] {
    const auto [nodes, mismatched] = store->joined_nodes(round);
    if (static_cast<int>(nodes.size()) >= min) store->close_round(round, nodes, restarts);
    return mismatched;
  }));
  for (const auto& why : left_out.value_or(std::vector<std::string>{})) {
    if (has_string(left_out_said_, why)) continue;  // (said once, not at every poll)
    left_out_said_.push_back(why);
    output_.log(why + "; leaving it out");
  }
}

// The store went away during a rendezvous (node 0's dtrun is gone): this node ends.
void Agent::end_on_lost_store(const std::exception& e) {
  lost_store(e);
  exit_code_ = failure_.exit_code;
  state_ = AgentState::kDone;
}

// The round failed before this node started it: after_failure decides (a restart or the end).
void Agent::failed_before_start(const RoundFailure& f) {
  failure_ = f;
  output_.log(describe(f) + (options_.coordinator() ? "; the round does not start" : "; not starting this node's workers"));
  after_failure();
}

void Agent::stop_in_rendezvous(int sig) {
  if (sig == 0 && !take_stop_signal(&sig)) sig = signals_->last_stop_signal();
  if (options_.elastic() && !was_member_) {  // (not part of the job yet: it leaves, the job goes on)
    output_.log("received " + signal_name(sig) + (options_.coordinator() ? " before a round began; ending" : " while waiting to join; leaving"));
    exit_code_ = 128 + sig;
    state_ = AgentState::kDone;
    return;
  }
  publish(signal_failure(sig));
  exit_code_ = 128 + sig;
  state_ = AgentState::kExitBarrier;
}

std::string Agent::ranks_here() const {
  const int first = group_rank() * options_.nproc_per_node, last = first + options_.nproc_per_node - 1;
  return first == last ? "rank " + std::to_string(first) : "ranks " + std::to_string(first) + "-" + std::to_string(last);
}

int Agent::group_rank() const {
  const auto it = std::find(members_.begin(), members_.end(), options_.node_rank);
  return it == members_.end() ? options_.node_rank : static_cast<int>(it - members_.begin());
}

RoundFailure Agent::lost_nodes(const std::vector<int>& stale) const {
  int left = 0;  // (--keep-survivors: the nodes lost before are not left either)
  for (int k : members_) left += has(stale, k) || has(lost_nodes_, k) ? 0 : 1;
  const bool go_on = options_.elastic() && left >= options_.min_nodes;
  std::string what = "the dtrun of node " + list(stale) + " stopped responding (no heartbeat for " +
                     seconds_text(options_.heartbeat_timeout_s) + ")";
  if (options_.elastic()) {
    what += "; " + std::to_string(left) + " node(s) left, " + (go_on ? "enough for" : "fewer than") + " --nnodes " +
            std::to_string(options_.min_nodes) + ":" + std::to_string(options_.nnodes);
  }
  return RoundFailure{stale.front(), 1, go_on, what};
}

std::optional<RoundFailure> Agent::news_of_nodes(const Poll& p) {
  if (options_.keep_survivors && !p.stale.empty()) {  // (agent_survivors.cpp)
    // (--nnodes MIN:MAX: fewer than MIN left ends the job as on the restart path; a fixed --nnodes
    // goes on with any survivors)
    RoundFailure f = lost_nodes(p.stale);
    if (options_.elastic() && !f.restartable) return f;
    keep_survivors_of_lost_nodes(p.stale);
    return std::nullopt;
  }
  if (options_.keep_survivors && p.waiting > 0) {  // Design note [nodes joining in process]
    admit_waiting_nodes();
    // (a member that asks to join again was taken as lost first: MIN as above)
    const int left = static_cast<int>(members_.size() - lost_nodes_.size());
    if (!options_.elastic() || left >= options_.min_nodes) return std::nullopt;
    return RoundFailure{lost_nodes_.empty() ? options_.node_rank : lost_nodes_.front(), 1, false, "node(s) " + list(lost_nodes_) + " lost: " + std::to_string(left) +
                        " node(s) left, fewer than --nnodes " + std::to_string(options_.min_nodes) + ":" +
                        std::to_string(options_.nnodes)};
  }
  if (p.stale.empty() && p.waiting == 0) return std::nullopt;
  RoundFailure f = !p.stale.empty() ? lost_nodes(p.stale)
                                    : RoundFailure{options_.node_rank, 1, true, std::to_string(p.waiting) +
                                                   " node(s) asked to join: restarting every worker at the new size"};
  f.membership = p.stale.empty();
  return f;
}

}  // namespace dtrain::launch
