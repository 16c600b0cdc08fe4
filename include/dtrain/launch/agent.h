#pragma once
// Agent: what one dtrun process does for its node, from rendezvous to exit code.
//
//   kRendezvous -> kRunning -> kWaitingPeers -> kExitBarrier -> kDone        (success)
//                      |             |
//                      v             v
//                  kStopping ---> (restart: kRendezvous of the next round | kExitBarrier)
//
// A "round" is one attempt of the whole job on every node (TORCHELASTIC_RESTART_COUNT). A round
// fails as soon as any worker on any node fails (or an agent is told to stop); then every agent
// stops its workers, and all restart together while restarts are left.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/launch/agent_store.h"
#include "dtrain/launch/options.h"
#include "dtrain/launch/prefixer.h"
#include "dtrain/launch/stall.h"

namespace dtrain::launch {

class StopSignals;
class WorkerGroup;

enum class AgentState {
  kRendezvous,    // waiting for every node's agent to join the current round
  kRunning,       // this node's workers run; watching them, the other nodes and the signals
  kStopping,      // stopping this node's workers (a failure somewhere, or a stop signal)
  kWaitingPeers,  // this node's workers all exited 0; waiting for the other nodes' outcome
  kExitBarrier,   // the outcome is final; node 0 keeps the store up until every agent saw it
  kDone,          // nothing left to do; the exit code is final
};
const char* to_string(AgentState state);

// Where an agent's output goes.
struct AgentOutput {
  OutputPrefixer::Sink out;                      // prefixed worker stdout segments
  OutputPrefixer::Sink err;                      // prefixed worker stderr segments
  std::function<void(const std::string&)> log;  // dtrun's own messages (one line, no "dtrun: ")
};
// dtrun's stdout, stderr, and "dtrun: <message>\n" on stderr.
AgentOutput standard_output();

class Agent {
 public:
  Agent(LaunchOptions options, AgentOutput output);
  ~Agent();

  // Runs the job on this node and returns dtrun's exit code: 0 when every worker everywhere
  // succeeded, else the failed worker's code (128 + N for signal N). Installs the signal handlers
  // for its duration. Throws LaunchError for launcher problems (program not found, store
  // unreachable, rendezvous timeout, ...).
  int run();

 private:
  void rendezvous();
  void running();
  void stopping();
  void waiting_peers();
  void exit_barrier();

  void start_workers();
  void publish(const RoundFailure& failure);     // report to the store, keep the round's winner
  void after_failure();                          // restart or finish, once workers are stopped
  void lost_store(const std::exception& e);
  bool take_stop_signal(int* sig);               // a new SIGINT/SIGTERM/... since the last call
  RoundFailure signal_failure(int sig) const;
  std::string describe(const RoundFailure& f) const;
  void wait_events(double seconds);              // sleeps, waking early for signals
  // Whether the agents coordinate through the store: several nodes (and the store still there).
  // One node's supervision (signals, workers' exits, restarts, stalls) never touches the store, so a
  // stalled or hostile store client cannot delay it (Design note [control plane]).
  bool coordinates() const { return options_.nnodes > 1 && store_ok_; }

  LaunchOptions options_;
  AgentOutput output_;
  std::string program_;
  std::vector<std::string> base_env_;
  AgentState state_ = AgentState::kRendezvous;
  int round_ = 0;
  int exit_code_ = 0;
  RoundFailure failure_;  // the current round's failure (valid in kStopping and after)
  bool store_ok_ = true;
  int stops_seen_ = 0;
  std::unique_ptr<StopSignals> signals_;
  std::unique_ptr<AgentStore> store_;
  std::unique_ptr<WorkerGroup> workers_;
  // Stall detection (Design note [stall detection], launch/stall.h): the workers' flight-recorder
  // files live in flight_dir_ (made at start, removed at exit).
  std::string flight_dir_;
  std::unique_ptr<StallMonitor> stall_;
  int reports_seen_ = 0;
  std::vector<WatchedRank> watched() const;
  bool check_stall();  // true when it ended the round
};

// dtrun's main: parses `args` (without argv[0]), runs the agent, prints errors ("dtrun: error:
// ..."); returns the process exit code (2 for a bad command line).
int dtrun_main(const std::vector<std::string>& args);

}  // namespace dtrain::launch
