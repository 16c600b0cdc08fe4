#include "dtrain/launch/agent.h"


#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "dtrain/launch/env.h"
#include "dtrain/launch/signals.h"
#include "dtrain/launch/workers.h"
#include "agent_internal.h"
#include "dtrain/util/fs.h"

namespace dtrain::launch {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
    } else {
      return;  // EPIPE, closed terminal, ...: output is lost, the job goes on
    }
  }
}

}  // namespace

const char* to_string(AgentState s) {
  switch (s) {
    case AgentState::kRendezvous: return "rendezvous";
    case AgentState::kRunning: return "running";
    case AgentState::kCoordinating: return "coordinating";
    case AgentState::kStopping: return "stopping";
    case AgentState::kWaitingPeers: return "waiting-peers";
    case AgentState::kExitBarrier: return "exit-barrier";
    case AgentState::kDone: return "done";
  }
  return "?";
}

AgentOutput standard_output() {
  AgentOutput o;
  o.out = [](std::string_view s) { write_all(1, s); };
  o.err = [](std::string_view s) { write_all(2, s); };
  o.log = [](const std::string& line) { write_all(2, "dtrun: " + line + "\n"); };
  return o;
}

Agent::Agent(LaunchOptions options, AgentOutput output) : options_(std::move(options)), output_(std::move(output)) {
  for (int k = 0; k < options_.nnodes; ++k) members_.push_back(k);
}

Agent::~Agent() {
  workers_.reset();  // kills and reaps anything still running before the store goes away
  calls_.reset();    // a call still running is left to the process's exit
  // The store is left to the process's end, not destroyed: destroying a TCPStore server joins its
  // daemon thread, which a client holding a half-sent request keeps blocked (Design note [control
  // plane]); dtrun is about to exit, and its exit ends that thread.
  (void)store_.release();
  if (!flight_dir_.empty()) util::fs::remove_all(flight_dir_);
}

std::vector<WatchedRank> Agent::watched() const {
  std::vector<WatchedRank> out;
  if (!workers_) return out;
  const auto pids = workers_->pids();
  for (size_t i = 0; i < pids.size(); ++i) {
    out.push_back({group_rank() * options_.nproc_per_node + static_cast<int>(i), pids[i]});
  }
  return out;
}

bool Agent::check_stall() {
  if (!stall_) return false;
  const auto ranks = watched();
  if (signals_->report_requests() != reports_seen_) {
    reports_seen_ = signals_->report_requests();
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.0f s", stall_->seconds_without_progress());
    output_.log(std::string("SIGUSR1: what each rank is doing (last progress ") + buf + " ago):\n" +
                stall_->report(ranks));
  }
  if (!stall_->stalled(ranks)) return false;
  const std::string what = "no rank" + std::string(options_.nnodes > 1 ? " of this node" : "") +
                           " made progress for " + seconds_text(options_.stall_timeout_s) + " (--stall-timeout)";
  output_.log(what + "; what each rank was doing:\n" + stall_->report(ranks));
  publish(RoundFailure{options_.node_rank, 1, true, what});
  workers_->stop(SIGTERM, ms(options_.term_timeout_s));
  state_ = AgentState::kStopping;
  return true;
}

// ---- helpers ----

bool Agent::take_stop_signal(int* sig) {
  int count = signals_->stop_count();
  if (count == stops_seen_) return false;
  stops_seen_ = count;
  *sig = signals_->last_stop_signal();
  return true;
}

RoundFailure Agent::signal_failure(int sig) const {
  std::string where = options_.nnodes > 1 ? " on node " + std::to_string(options_.node_rank) : "";
  return RoundFailure{options_.node_rank, 128 + sig, false, "dtrun" + where + " received " + signal_name(sig)};
}

std::string Agent::describe(const RoundFailure& f) const {
  if (options_.nnodes > 1 && f.what.rfind("worker ", 0) == 0) return "node " + std::to_string(f.node) + ": " + f.what;
  return f.what;
}

void Agent::wait_events(double seconds) {
  pollfd p{signals_->fd(), POLLIN, 0};
  ::poll(&p, 1, static_cast<int>(ms(seconds).count()));
  signals_->drain();
}

void Agent::publish(const RoundFailure& f) {
  failure_ = f;
  if (!coordinates()) return;
  AgentStore* store = store_.get();
  const int round = round_;
  reports_.push_back(calls_->submit([store, round, f] { return store->report_failure(round, f); }));
}

void Agent::collect_reports() {
  for (auto it = reports_.begin(); it != reports_.end();) {
    if (!ready(*it)) {
      ++it;
      continue;
    }
    try {
      failure_ = it->get();  // the round's winner
    } catch (const std::exception& e) {
      lost_store(e);
    }
    it = reports_.erase(it);
  }
}

std::future<Agent::Poll> Agent::start_poll() {
  AgentStore* store = store_.get();
  const int round = round_;
  const auto timeout = ms(options_.heartbeat_timeout_s);
  poll_started_ = Clock::now();
  // (node 0 of an elastic job with room for more: nodes waiting to join the next round)
  const bool room = options_.elastic() && options_.node_rank == 0 &&
                    static_cast<int>(members_.size()) - static_cast<int>(lost_nodes_.size()) < options_.nnodes;
  // (a coordinator also learns when the round is over: waiting_peers()'s question)
  const int done_at = options_.coordinator() ? static_cast<int>(members_.size()) : 0;
  return calls_->submit([store, round, timeout, room, done_at, survivors = options_.keep_survivors] {
    Poll p;
    p.failure = store->failure(round);
    if (!p.failure) p.stale = store->heartbeat(timeout);
    if (!p.failure && room) p.waiting = store->joined_count(round + 1);
    if (!p.failure && done_at > 0 && (survivors ? store->not_finished(round).empty() : store->done_count(round) >= done_at))
      p.all_done = store->finished_code(round);
    return p;
  });
}

std::optional<Agent::Poll> Agent::take_poll() {
  if (!poll_.valid()) {
    if (Clock::now() >= next_poll_) poll_ = start_poll();
    return std::nullopt;
  }
  if (!ready(poll_)) {
    if (Clock::now() - poll_started_ >= ms(options_.heartbeat_timeout_s))
      throw std::runtime_error("no answer within " + seconds_text(options_.heartbeat_timeout_s) +
                               " (--heartbeat-timeout)");
    return std::nullopt;
  }
  next_poll_ = Clock::now() + ms(options_.monitor_interval_s);
  auto p = poll_.get();  // invalidates poll_; throws what the call threw
  return p;
}

void Agent::lost_store(const std::exception& e) {
  if (!store_ok_) return;
  store_ok_ = false;
  std::string what = e.what();
  what = what.substr(0, what.find('\n'));
  output_.log("lost the agent store at " + options_.master_addr + ":" + std::to_string(options_.master_port) +
              " (" + what + "); node 0's dtrun is gone, or this node is cut off from it");
  if (failure_.what.empty())
    failure_ = RoundFailure{options_.node_rank, 1, false, "lost the agent store (node 0's dtrun is gone)"};
  failure_.restartable = false;  // nobody can coordinate a restart without the store
}

// ---- the states ----

int Agent::run() {
  signals_ = std::make_unique<StopSignals>();
  // Orphaned grandchildren of the workers are re-parented to dtrun (not init), so dtrun can
  // reap them and knows when a worker's process group is really empty.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  const char* path = std::getenv("PATH");
  // (a coordinator starts no program: it need not be installed there)
  program_ = options_.coordinator() ? options_.command.at(0) : resolve_program(options_.command.at(0), path ? path : "");
  base_env_ = current_env();
  if (!options_.coordinator()) place_workers();
  if (!options_.coordinator()) {
    std::string tmpl = util::fs::temp_directory() + "/dtrun-flight-XXXXXX";
    if (::mkdtemp(tmpl.data())) flight_dir_ = tmpl;
    if (options_.stall_timeout_s > 0 && !flight_dir_.empty()) {
      stall_ = std::make_unique<StallMonitor>(flight_dir_, options_.stall_timeout_s);
    }
  }

  try {
    store_ = std::make_unique<AgentStore>(options_, [this] { return signals_->stop_count() > 0; });
  } catch (const LaunchError& e) {
    if (signals_->stop_count() == 0) throw;
    int sig = signals_->last_stop_signal();
    throw LaunchError("received " + signal_name(sig) + " while waiting for node 0's agent store", 128 + sig);
  }
  options_.master_port = store_->port();
  if (options_.nnodes > 1) calls_ = std::make_unique<StoreThread>();  // Design note [agents never wait on the store]
  if (options_.nnodes > 1 && options_.job_secret.empty() && options_.node_rank == 0) {
    output_.log("warning: no job secret (--job-secret-file or DTRAIN_JOB_SECRET on every node): anyone who reaches " +
                options_.master_addr + ":" + std::to_string(options_.master_port) +
                " can read and steer this job's agent store");
  }
  if (options_.nnodes > 1 && options_.node_rank == 0)
    output_.log("agent store listening on " + options_.master_addr + ":" + std::to_string(options_.master_port) +
                " (run id " + options_.run_id + "); " +
                (options_.coordinator() ? "coordinating (no workers here): waiting for " + std::to_string(options_.min_nodes) +
                                              " to " + std::to_string(options_.nnodes) + " training node(s), 1.." +
                                              std::to_string(options_.nnodes)
                                        : "waiting for " +
                                              (options_.elastic() ? std::to_string(options_.min_nodes - 1) + " to " : std::string()) +
                                              std::to_string(options_.nnodes - 1) + " more node(s)"));

  while (state_ != AgentState::kDone) {
    switch (state_) {
      case AgentState::kRendezvous: rendezvous(); break;
      case AgentState::kRunning: running(); break;
      case AgentState::kCoordinating: coordinating(); break;
      case AgentState::kStopping: stopping(); break;
      case AgentState::kWaitingPeers: waiting_peers(); break;
      case AgentState::kExitBarrier: exit_barrier(); break;
      case AgentState::kDone: break;
    }
  }
  workers_.reset();
  return exit_code_;
}

void Agent::running() {
  next_poll_ = Clock::now();
  for (;;) {
    workers_->poll(ms(options_.monitor_interval_s), {signals_->fd()});
    signals_->drain();

    int sig = 0;
    if (take_stop_signal(&sig)) {
      output_.log("received " + signal_name(sig) + "; forwarding it to the workers");
      publish(signal_failure(sig));
      workers_->stop(sig, ms(options_.term_timeout_s));
      state_ = AgentState::kStopping;
      return;
    }
    if (keep_survivor_of_failure()) {
      if (state_ != AgentState::kRunning) return;
      continue;
    }
    if (const auto& e = workers_->first_failure()) {
      output_.log(e->describe() + "; stopping the other workers" + (options_.nnodes > 1 ? " on every node" : ""));
      if (!e->last_error.empty()) output_.log("rank " + std::to_string(e->rank) + "'s last error output: " + e->last_error);
      publish(RoundFailure{options_.node_rank, e->exit_code(), true, e->describe()});
      workers_->stop(SIGTERM, ms(options_.term_timeout_s));
      state_ = AgentState::kStopping;
      return;
    }
    if (check_stall()) return;
    if (workers_->phase() == WorkerGroup::Phase::kDone) {  // every worker exited 0
      if (!failed_.empty()) output_.log("the surviving workers exited 0 (lost on the way: rank(s) " + failed_ + ")");
      if (!coordinates()) {
        exit_code_ = 0;
        state_ = AgentState::kExitBarrier;
        return;
      }
      AgentStore* store = store_.get();
      const int round = round_;
      reports_done_ = calls_->submit([store, round] { store->report_done(round); return true; });
      state_ = AgentState::kWaitingPeers;
      return;
    }
    if (!coordinates()) continue;
    try {
      collect_reports();
      auto poll = take_poll();
      if (!poll) continue;
      if (auto f = poll->failure) {
        failure_ = *f;
        output_.log(describe(*f) + "; stopping this node's workers");
        workers_->stop(SIGTERM, ms(options_.term_timeout_s));
        state_ = AgentState::kStopping;
        return;
      }
      if (auto f = news_of_nodes(*poll)) {
        output_.log(f->what + "; stopping this node's workers");
        publish(*f);
        workers_->stop(SIGTERM, ms(options_.term_timeout_s));
        state_ = AgentState::kStopping;
        return;
      }
    } catch (const std::exception& e) {
      lost_store(e);
      workers_->stop(SIGTERM, ms(options_.term_timeout_s));
      state_ = AgentState::kStopping;
      return;
    }
  }
}

void Agent::stopping() {
  while (workers_->phase() != WorkerGroup::Phase::kDone) {
    workers_->poll(ms(options_.monitor_interval_s), {signals_->fd()});
    signals_->drain();
    int sig = 0;
    if (take_stop_signal(&sig)) {
      if (failure_.restartable) {
        publish(signal_failure(sig));  // no restart now, on any node
        workers_->stop(sig, ms(options_.term_timeout_s));
      } else {
        output_.log("received " + signal_name(sig) + " again; killing the workers");
        workers_->stop(SIGKILL, milliseconds(0));
      }
    }
    if (coordinates()) {
      try {  // keeps this node's heartbeat going; news of the round come in after_failure()
        collect_reports();
        take_poll();
      } catch (const std::exception& e) {
        lost_store(e);
      }
    }
  }
  after_failure();
}

void Agent::after_failure() {
  if (coordinates()) {
    try {  // the final word on this round (after this node's reports): a stop request anywhere
           // overrides a worker failure
      for (auto& r : reports_) {
        if (auto winner = await(std::move(r))) failure_ = *winner;
      }
      reports_.clear();
      AgentStore* store = store_.get();
      const int round = round_;
      if (auto f = await(calls_->submit([store, round] { return store->failure(round); }))) {
        if (*f) failure_ = **f;
      }
    } catch (const std::exception& e) {
      lost_store(e);
    }
    poll_ = {};
  }
  int sig = 0;
  if (take_stop_signal(&sig)) {  // came while waiting for the store: no restart
    output_.log("received " + signal_name(sig) + "; not restarting");
    publish(signal_failure(sig));
  }
  workers_.reset();
  const bool counted = !failure_.membership;  // (a node joining: Design note [elastic membership])
  if (options_.keep_survivors && failure_.restartable && replaced_in_round_ > 0 && restart_requested()) {
    // (the survivors refused to go on in process: this round's replacements are stopped with them,
    // and their restarts go to the restart of every worker)
    restarts_used_ -= replaced_in_round_;
    replaced_in_round_ = 0;
  }
  if (failure_.restartable && (store_ok_ || options_.nnodes == 1) && (!counted || restarts_used_ < options_.max_restarts)) {
    if (counted) ++restarts_used_;
    const std::string whose = options_.coordinator() ? "every node's workers" : "workers";
    output_.log(counted ? "restarting " + whose + " (attempt " + std::to_string(restarts_used_ + 1) + "/" +
                              std::to_string(options_.max_restarts + 1) + ") after " + describe(failure_)
                        : "restarting " + whose + " for a new membership: " + describe(failure_));
    ++round_;
    state_ = AgentState::kRendezvous;
    return;
  }
  exit_code_ = failure_.exit_code;
  std::string attempts = failure_.restartable && restarts_used_ > 0 ? " after " + std::to_string(restarts_used_ + 1) + " attempts" : "";
  output_.log("failed" + attempts + ": " + describe(failure_) + " (exit code " + std::to_string(exit_code_) + ")");
  state_ = AgentState::kExitBarrier;
}

void Agent::waiting_peers() {
  AgentStore* store = store_.get();
  const int round = round_;
  const auto hb = ms(options_.heartbeat_timeout_s);
  struct Outcome {
    std::optional<RoundFailure> failure;
    bool all_done = false;
    std::vector<int> stale;
  };
  for (;;) {
    int sig = 0;
    if (take_stop_signal(&sig)) {
      output_.log("received " + signal_name(sig) + " while waiting for the other nodes");
      publish(signal_failure(sig));
      exit_code_ = failure_.exit_code;
      state_ = AgentState::kExitBarrier;
      return;
    }
    try {
      collect_reports();
      if (reports_done_.valid() && !await(std::move(reports_done_))) continue;
      const bool survivors = options_.keep_survivors;  // (nodes that left or were lost do not count)
      auto seen = await(calls_->submit([store, round, hb, survivors, nnodes = static_cast<int>(members_.size())] {
        Outcome o;
        o.failure = store->failure(round);
        if (o.failure) return o;
        o.all_done = survivors ? store->not_finished(round).empty() : store->done_count(round) >= nnodes;
        if (!o.all_done) o.stale = store->heartbeat(hb);
        return o;
      }));
      if (!seen) continue;  // a stop signal: taken above
      if (auto f = seen->failure) {
        failure_ = *f;
        output_.log(describe(*f) + "; this node's workers had already finished");
        after_failure();
        return;
      }
      if (seen->all_done) {
        exit_code_ = left_code_;  // (0, or --keep-survivors: this node's workers all failed)
        state_ = AgentState::kExitBarrier;
        return;
      }
      Poll news;
      news.stale = seen->stale;
      if (auto f = news_of_nodes(news)) {
        publish(*f);
        after_failure();
        return;
      }
    } catch (const std::exception& e) {
      lost_store(e);
      exit_code_ = failure_.exit_code;
      state_ = AgentState::kDone;
      return;
    }
    wait_events(options_.monitor_interval_s);
  }
}

void Agent::exit_barrier() {
  state_ = AgentState::kDone;
  if (!coordinates()) return;
  AgentStore* store = store_.get();
  const auto hb = ms(options_.heartbeat_timeout_s);
  try {
    // This node's reports first (a stop request must reach the others), then the arrival.
    for (auto& r : reports_) await(std::move(r));
    reports_.clear();
    int sig = 0;
    if (!await(calls_->submit([store] { store->arrive_exit(); return true; })) && take_stop_signal(&sig)) return;
    if (options_.node_rank != 0) return;
    // Node 0 hosts the store: stay until every agent has read the outcome from it.
    const auto deadline = Clock::now() + ms(options_.rdzv_timeout_s);
    std::vector<int> waiting;
    for (;;) {
      auto seen = await(calls_->submit([store, hb] { return std::make_pair(store->not_yet_exited(), store->heartbeat(hb)); }));
      if (seen) {
        waiting = seen->first;
        if (waiting.empty()) return;
      }
      if ((seen && !seen->second.empty()) || take_stop_signal(&sig) || Clock::now() >= deadline) {
        output_.log("not waiting any longer for node(s) " + list(waiting) + " to finish");
        return;
      }
      wait_events(options_.monitor_interval_s);
    }
  } catch (const std::exception& e) {
    lost_store(e);
  }
}

// ---- main ----

int dtrun_main(const std::vector<std::string>& args) {
  // Make sure 0, 1 and 2 are open, so no pipe or socket lands on them.
  for (int fd = 0; fd < 3; ++fd)
    if (fcntl(fd, F_GETFD) == -1) open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
  try {
    LaunchOptions options = parse_args(args);
    if (options.help) {
      write_all(1, usage());
      return 0;
    }
    options.stdout_isatty = isatty(1) == 1;
    Agent agent(std::move(options), standard_output());
    return agent.run();
  } catch (const UsageError& e) {
    write_all(2, std::string("dtrun: error: ") + e.what() + "\nTry 'dtrun --help' for the list of flags.\n");
    return e.exit_code();
  } catch (const LaunchError& e) {
    write_all(2, std::string("dtrun: error: ") + e.what() + "\n");
    return e.exit_code();
  } catch (const std::exception& e) {
    write_all(2, std::string("dtrun: internal error: ") + e.what() + "\n");
    return 1;
  }
}

}  // namespace dtrain::launch
