// dtrun --keep-survivors (Design note [in-process recovery], include/dtrain/train/elastic.h): the
// agent's side. A failed worker, or a node gone silent, is declared dead to the workers through the
// store instead of stopping the job; the workers regroup without it.
#include <algorithm>
#include <string>
#include <vector>

#include "agent_internal.h"
#include "dtrain/launch/agent.h"

namespace dtrain::launch {

namespace {
std::string how_it_ended(const WorkerExit& e) {
  const std::string d = e.describe();  // "worker rank 1 (local 1, pid 1234) was killed by ..."
  return d.substr(d.find(") ") + 2);
}
}  // namespace

bool Agent::marked_dead(int rank) {
  try {
    AgentStore* store = store_.get();
    const int round = round_;
    if (!calls_) return store->marked_dead(round, rank);
    return await(calls_->submit([store, round, rank] { return store->marked_dead(round, rank); })).value_or(false);
  } catch (const std::exception&) {
    return false;
  }
}

std::optional<std::string> Agent::restart_requested() {
  try {
    AgentStore* store = store_.get();
    const int round = round_;
    if (!calls_) return store->restart_requested(round);
    return await(calls_->submit([store, round] { return store->restart_requested(round); })).value_or(std::nullopt);
  } catch (const std::exception& x) {
    output_.log(std::string("could not read the workers' news from the store: ") + x.what());
    return std::nullopt;
  }
}

void Agent::declare_dead(int rank, const std::string& why) {
  try {
    AgentStore* store = store_.get();
    const int round = round_;
    if (calls_) {  // (Design note [agents never wait on the store])
      await(calls_->submit([store, round, rank, why] { store->declare_dead(round, rank, why); return true; }));
    } else {
      store->declare_dead(round, rank, why);
    }
  } catch (const std::exception& x) {
    output_.log(std::string("could not tell the workers through the store: ") + x.what());
  }
  if (!failed_.empty()) failed_ += ", ";
  failed_ += std::to_string(rank);
}

bool Agent::keep_survivor_of_failure() {
  const auto& e = workers_->first_failure();
  if (!e || !options_.keep_survivors) return false;
  const WorkerExit failed = *e;
  if (const auto why = restart_requested()) {  // (the survivors refused to go on in process)
    output_.log("the workers cannot go on in process (" + *why + "): the round fails, a restart (--max-restarts) "
                "starts every worker again from the newest checkpoint");
    return false;
  }
  const int left = workers_->running();
  // (the last one: the group failed as it would without the flag, unless it left itself out of
  // the survivors' generation (elastic/dead, which only it writes before this dtrun does) after
  // they finished the run: back from being stuck in compute, it is one more lost on the way)
  const bool left_behind = left == 0 && workers_->succeeded() > 0 && marked_dead(failed.rank);
  if (left == 0 && options_.nnodes == 1 && !left_behind) return false;
  workers_->accept_failure();
  if (!failed.last_error.empty()) output_.log("rank " + std::to_string(failed.rank) + "'s last error output: " + failed.last_error);
  declare_dead(failed.rank, "worker rank " + std::to_string(failed.rank) + " " + how_it_ended(failed));
  if (left_behind) {  // (this node's survivors finished the run before it)
    output_.log(failed.describe() + " after this node's other workers had finished: one more lost on the way");
    if (options_.nnodes == 1) return true;  // (running() then ends 0, naming it)
    const int round = round_;
    AgentStore* store = store_.get();
    reports_done_ = calls_->submit([store, round] { store->report_done(round); return true; });
    state_ = AgentState::kWaitingPeers;
    return true;
  }
  if (left == 0) {  // (several nodes: this node finishes as if its workers had ended; the others go on)
    output_.log(failed.describe() + "; no worker is left on this node: the other node(s) go on, and this dtrun "
                "waits for them and exits with this worker's code");
    left_code_ = failed.exit_code();
    AgentStore* store = store_.get();
    const int round = round_;
    const int code = left_code_;
    reports_done_ = calls_->submit([store, round, code] { store->report_done(round, code); return true; });
    state_ = AgentState::kWaitingPeers;
    return true;
  }
  output_.log(failed.describe() + "; the other " + std::to_string(left) + " worker(s) go on (--keep-survivors)");
  if (restarts_used_ < options_.max_restarts) start_replacement(failed);
  return true;
}

void Agent::keep_survivors_of_lost_nodes(const std::vector<int>& stale) {
  for (int node : stale) {
    const auto at = std::find(members_.begin(), members_.end(), node);
    if (at == members_.end() || std::find(lost_nodes_.begin(), lost_nodes_.end(), node) != lost_nodes_.end()) continue;
    lost_nodes_.push_back(node);
    const bool joined = std::find(joined_in_process_.begin(), joined_in_process_.end(), node) != joined_in_process_.end();
    const int per_node = workers_per_node();
    const int first = static_cast<int>(at - members_.begin()) * per_node;
    output_.log("the dtrun of node " + std::to_string(node) + " stopped responding (no heartbeat for " +
                std::to_string(static_cast<int>(options_.heartbeat_timeout_s)) + " s): its " +
                (joined ? std::string("workers") : "rank(s) " + std::to_string(first) + "-" +
                                                      std::to_string(first + per_node - 1)) +
                " (and any replacement it started) declared dead; the workers here go on (--keep-survivors)");
    std::vector<int> ranks;  // (a node that joined a running round has only the ids it was given)
    for (int r = first; r < first + per_node && !joined; ++r) ranks.push_back(r);
    AgentStore* store = store_.get();
    if (auto more = await(calls_->submit([store, node] { return store->replacements_on(node); }))) {
      ranks.insert(ranks.end(), more->begin(), more->end());  // (the replacements it had started)
    }
    for (int r : ranks) declare_dead(r, "node " + std::to_string(node) + " (its dtrun) stopped responding");
    const int round = round_;  // (an admission it never read: not for its next life)
    await(calls_->submit([store, round, node] { store->forget_admission(round, node); return true; }));
  }
  watch_alive_members();
}

// The store watches the round's members this node has not found lost (heartbeats, not_finished).
void Agent::watch_alive_members() {
  std::vector<int> watched;
  for (int k : members_) {
    if (std::find(lost_nodes_.begin(), lost_nodes_.end(), k) == lost_nodes_.end()) watched.push_back(k);
  }
  AgentStore* store = store_.get();
  await(calls_->submit([store, watched] { store->watch(watched); return true; }));
}

void Agent::admit_waiting_nodes() {
  AgentStore* store = store_.get();
  const int round = round_;
  const auto joined = await(calls_->submit([store, round] { return store->joined_nodes(round + 1).first; }));
  if (!joined) return;
  for (int node : *joined) {
    const int alive = static_cast<int>(members_.size()) - static_cast<int>(lost_nodes_.size());
    const bool lost = std::find(lost_nodes_.begin(), lost_nodes_.end(), node) != lost_nodes_.end();
    const bool member = std::find(members_.begin(), members_.end(), node) != members_.end();
    if (member && !lost) {
      // (a member cannot wait for the next round: its dtrun came back before its heartbeat went
      // stale here, so the one that ran its workers is gone: their ranks are dead)
      output_.log("node " + std::to_string(node) + " asks to join again: its dtrun of this round is gone");
      keep_survivors_of_lost_nodes({node});
      return;  // (admitted at the next poll, as a lost node that came back)
    }
    if (alive >= options_.nnodes) continue;  // (no room)
    std::vector<int> ids;
    for (int k = 0; k < workers_per_node(); ++k) {
      auto n = await(calls_->submit([store] { return store->next_replacement(); }));
      if (!n) return;  // (a stop signal meanwhile)
      ids.push_back(options_.nnodes * workers_per_node() + *n - 1);  // (the world size and up)
    }
    await(calls_->submit([store, round, node, ids] {
      for (int id : ids) store->record_replacement(node, id);
      store->admit(round, node, ids);
      return true;
    }));
    if (lost) lost_nodes_.erase(std::find(lost_nodes_.begin(), lost_nodes_.end(), node));
    if (!member) {
      members_.push_back(node);
      joined_in_process_.push_back(node);
    }
    std::string list_ids;
    for (int id : ids) list_ids += (list_ids.empty() ? "" : ", ") + std::to_string(id);
    output_.log("node " + std::to_string(node) + " joins the running round " + std::to_string(round) +
                " in process (--keep-survivors): its worker(s), rank(s) " + list_ids + ", join at the next step");
  }
  watch_alive_members();
}

void Agent::join_running_round(const std::pair<int, std::vector<int>>& adm) {
  round_ = adm.first;
  admitted_ids_ = adm.second;
  AgentStore* store = store_.get();
  const int round = round_;
  std::vector<int> members;  // (the round's members as node 0 closed it)
  if (auto closed = await(calls_->submit([store, round] { return store->members(round); }))) {
    if (*closed) members = **closed;
  }
  if (std::find(members.begin(), members.end(), options_.node_rank) == members.end()) members.push_back(options_.node_rank);
  const int restarts = await(calls_->submit([store, round] { return store->restarts_of(round); })).value_or(0);
  become_member(members, restarts);
}

// --keep-survivors with --max-restarts: a new process in the failed one's place that joins the
// running job at its next step, under an id no process of the job had (the world size and up, one
// count for the job: DTRAIN_ELASTIC_JOIN), which names it in the store and the output.
void Agent::start_replacement(const WorkerExit& failed) {
  ++restarts_used_;
  ++replaced_in_round_;
  AgentStore* store = store_.get();
  const auto n = calls_ ? await(calls_->submit([store] { return store->next_replacement(); }))
                        : std::optional<int>(store->next_replacement());
  if (!n) return;  // (a stop signal meanwhile)
  const int rank = options_.world_size() + *n - 1;
  if (calls_) {  // (so that the other nodes can declare it dead with this node)
    const int node = options_.node_rank;
    await(calls_->submit([store, node, rank] { store->record_replacement(node, rank); return true; }));
  }
  // (RANK stays the lost rank's, within WORLD_SIZE as every launcher sets it; the id is the variable's)
  WorkerSpec spec = spec_for(failed.local_rank, {{"DTRAIN_ELASTIC_JOIN", std::to_string(rank)}});
  spec.rank = rank;
  output_.log("starting rank " + std::to_string(spec.rank) + " (local " + std::to_string(spec.local_rank) +
              ") in rank " + std::to_string(failed.rank) + "'s place; it joins at the next step (replacement " +
              std::to_string(restarts_used_) + "/" + std::to_string(options_.max_restarts) + ")");
  workers_->add(program_, options_.command, spec);
}

}  // namespace dtrain::launch
