#include "dtrain/launch/agent.h"

#include "dtrain/compat.h"

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

#include "dtrain/launch/cores.h"
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
  return calls_->submit([store, round, timeout, room] {
    Poll p;
    p.failure = store->failure(round);
    if (!p.failure) p.stale = store->heartbeat(timeout);
    if (!p.failure && room) p.waiting = store->joined_count(round + 1);
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
  program_ = resolve_program(options_.command.at(0), path ? path : "");
  base_env_ = current_env();
  place_workers();
  {
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
                " (run id " + options_.run_id + "); waiting for " +
                (options_.elastic() ? std::to_string(options_.min_nodes - 1) + " to " : std::string()) +
                std::to_string(options_.nnodes - 1) + " more node(s)");

  while (state_ != AgentState::kDone) {
    switch (state_) {
      case AgentState::kRendezvous: rendezvous(); break;
      case AgentState::kRunning: running(); break;
      case AgentState::kStopping: stopping(); break;
      case AgentState::kWaitingPeers: waiting_peers(); break;
      case AgentState::kExitBarrier: exit_barrier(); break;
      case AgentState::kDone: break;
    }
  }
  workers_.reset();
  return exit_code_;
}

void Agent::place_workers() {
  const char* preload = std::getenv("LD_PRELOAD");
  const bool preloaded = preload && *preload;  // (auto leaves a preload the user chose alone: a sanitizer, an allocator)
  allocator_ = choose_allocator(preloaded && options_.allocator == "auto" ? "system" : options_.allocator,
                                [](const std::string& p) { return util::fs::exists(p); });
  std::string placed = "workers run on " + launch::describe(allocator_) + " (--allocator " + options_.allocator +
                       (preloaded && options_.allocator == "auto" ? ", LD_PRELOAD already set" : "") + ")";
  if (options_.bind_cores != "off") {
    const std::vector<int> cores = by_physical_core(allowed_cores(), physical_core_of);
    core_runs_ = split_cores(cores, options_.nproc_per_node, numa_nodes());
    if (core_runs_.empty() && options_.bind_cores == "on") {
      throw UsageError("--bind-cores on: " + std::to_string(options_.nproc_per_node) + " workers cannot have a core each on " +
                       std::to_string(cores.size()) + " core(s) (" + cpu_list(cores) + "); use --bind-cores off");
    }
  }
  if (!core_runs_.empty()) {
    placed += "; each bound to its cores:";
    for (size_t r = 0; r < core_runs_.size(); ++r) placed += (r ? ", " : " ") + cpu_list(core_runs_[r]);
    placed += " (--bind-cores " + options_.bind_cores + ")";
  }
  output_.log(placed);
}

WorkerSpec Agent::spec_for(int local_rank, const EnvMap& extra) const {
  WorkerSpec spec;
  spec.local_rank = local_rank;
  spec.rank = group_rank() * options_.nproc_per_node + local_rank;
  LaunchOptions dense = options_;  // (ranks over the round's members: Design note [elastic membership])
  dense.node_rank = group_rank();
  dense.nnodes = static_cast<int>(members_.size());
  EnvMap env = worker_env(dense, local_rank, round_);
  // As torchrun: NCCL's watchdog turns a hung collective into a crash that dtrun can see. The
  // name this libtorch reads (compat::kNcclAsyncErrorEnv); a value the user set under either
  // name is left alone.
  if (!std::getenv("NCCL_ASYNC_ERROR_HANDLING") && !std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    env[compat::kNcclAsyncErrorEnv] = "1";
  }
  if (!flight_dir_.empty()) env["DTRAIN_FLIGHT_DIR"] = flight_dir_;  // Design note [flight recorder]
  if (!options_.job_secret.empty()) env["DTRAIN_JOB_SECRET"] = options_.job_secret;  // Design note [control plane]
  const char* preload = std::getenv("LD_PRELOAD");
  for (const auto& [k, v] : allocator_env(allocator_, preload ? preload : "")) env[k] = v;  // Design note [the workers' allocator]
  if (!core_runs_.empty()) {  // Design note [ranks bound to cores]
    spec.cores = core_runs_.at(static_cast<size_t>(local_rank));
    const char* omp = std::getenv("OMP_NUM_THREADS");
    if (!omp || !*omp) env["OMP_NUM_THREADS"] = std::to_string(spec.cores.size());
  }
  for (const auto& [k, v] : extra) env[k] = v;
  spec.env = merge_env(base_env_, env);
  return spec;
}

void Agent::start_workers() {
  std::vector<WorkerSpec> specs;
  for (int lr = 0; lr < options_.nproc_per_node; ++lr) {
    if (admitted_ids_.empty()) {
      specs.push_back(spec_for(lr));
      continue;
    }
    // (a node admitted into a running round: its workers join it, Design note [nodes joining in process])
    const int id = admitted_ids_.at(static_cast<size_t>(lr));
    specs.push_back(spec_for(lr, {{"DTRAIN_ELASTIC_JOIN", std::to_string(id)}}));
    specs.back().rank = id;
  }
  workers_.reset();
  workers_ = std::make_unique<WorkerGroup>(output_.out, output_.err, output_.log, ms(options_.term_timeout_s));
  if (store_->server_pid() > 0) workers_->spare(store_->server_pid());
  if (options_.nnodes > 1 && !options_.elastic()) {  // (elastic: the round's members were said)
    int first = specs.front().rank, last = specs.back().rank;
    output_.log("all " + std::to_string(members_.size()) + " nodes joined; starting ranks " + std::to_string(first) +
                (last != first ? "-" + std::to_string(last) : "") + " of " +
                std::to_string(static_cast<int>(members_.size()) * options_.nproc_per_node) +
                (round_ > 0 ? " (restart " + std::to_string(round_) + ")" : ""));
  }
  workers_->start(program_, options_.command, specs);
  if (stall_) stall_->reset();
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
      const auto& stale = poll->stale;
      if (options_.keep_survivors && !stale.empty()) {  // (agent_survivors.cpp)
        keep_survivors_of_lost_nodes(stale);
        continue;
      }
      if (options_.keep_survivors && poll->waiting > 0) {  // Design note [nodes joining in process]
        admit_waiting_nodes();
        continue;
      }
      if (!stale.empty() || poll->waiting > 0) {
        RoundFailure f = !stale.empty() ? lost_nodes(stale)
                                        : RoundFailure{options_.node_rank, 1, true, std::to_string(poll->waiting) +
                                                       " node(s) asked to join: restarting every worker at the new size"};
        f.membership = stale.empty();
        output_.log(f.what + "; stopping this node's workers");
        publish(f);
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
  if (failure_.restartable && (store_ok_ || options_.nnodes == 1) && (!counted || restarts_used_ < options_.max_restarts)) {
    if (counted) ++restarts_used_;
    output_.log(counted ? "restarting workers (attempt " + std::to_string(restarts_used_ + 1) + "/" +
                              std::to_string(options_.max_restarts + 1) + ") after " + describe(failure_)
                        : "restarting workers for a new membership: " + describe(failure_));
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
      const auto& stale = seen->stale;
      if (options_.keep_survivors && !stale.empty()) {
        keep_survivors_of_lost_nodes(stale);
        continue;
      }
      if (!stale.empty()) {
        publish(lost_nodes(stale));
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
