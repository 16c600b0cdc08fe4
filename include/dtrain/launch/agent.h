#pragma once
// Agent: what one dtrun process does for its node, from rendezvous to exit code.
//
//   kRendezvous -> kRunning -> kWaitingPeers -> kExitBarrier -> kDone        (success)
//   kRendezvous -> kCoordinating -> kExitBarrier | kRendezvous  (a coordinator node 0: Design note
//                                                               [a coordinator node])
//                      |             |
//                      v             v
//                  kStopping ---> (restart: kRendezvous of the next round | kExitBarrier)
//
// A "round" is one attempt of the whole job on every node (TORCHELASTIC_RESTART_COUNT). A round
// fails as soon as any worker on any node fails (or an agent is told to stop); then every agent
// stops its workers, and all restart together while restarts are left.
//
// Design note [elastic membership]: with --nnodes MIN:MAX a round's nodes are decided, not fixed.
// Node 0 (which hosts the store, so it is the one node the job cannot lose, unless it is a
// coordinator: below) closes a round once
// MAX nodes joined it, or once MIN had and --rdzv-last-call passed without more, and writes its
// members; the workers' ranks are dense over them (group rank = index among the members, world =
// members x --nproc-per-node). A member whose dtrun stops responding fails the round as a
// restartable failure while MIN members are left (counted against --max-restarts, as a worker's
// failure; fewer left ends the job as today); a node that starts late (or comes back) joins the
// round after the newest closed one, and node 0, seeing it wait while the round has fewer than MAX
// members, ends the round as a membership change, which restarts every worker without counting.
// The training state crosses the change as across any restart: the program resumes from its newest
// checkpoint (dtrain's load at any world size; --global-batch-size keeps the batch). torchrun's
// elastic agent does the same; keeping the survivors' processes and memory is the library's part.
//
// Design note [nodes joining in process]: with --keep-survivors (the workers run the library's
// --elastic loop) a membership change restarts nothing. A node lost is dropped as under a fixed
// --nnodes while MIN nodes are left (its ranks declared dead; the survivors regroup in process;
// fewer end the job as on the restart path). A node that starts late or
// comes back joins round + 1 as above, and node 0, where the running round has room (fewer than MAX
// nodes alive in it), admits it into the running round instead of ending it: it gives the node's
// workers ids no process of the job had (as a replacement's: MAX x the training nodes' --nproc-per-node and up, recorded for
// the node so a later loss declares them dead), writes them under the node's join of round + 1,
// and watches the node from then on. The node reads its admission while it waits, becomes a member
// of the running round, and starts its workers as joiners (DTRAIN_ELASTIC_JOIN): they are taken in
// at the next step the members commit and receive their state from the live ranks (Design note
// [in-process recovery], train/elastic.h). The node then finishes with the round like any member.
//
// Design note [a coordinator node]: node 0 hosts the agent store (the workers' too), so it is the
// one node an elastic job cannot lose, and with workers of its own it is also the node most likely
// to fail. Started with --nproc-per-node 0, node 0 trains nothing: it hosts the store, closes the
// rounds, declares lost nodes' ranks dead and admits joiners (kCoordinating: the running and
// waiting duties of node 0 without workers), but never joins a round, so every training node,
// numbered 1..MAX, can be lost, the one holding rank 0 included. MIN:MAX counts the training nodes;
// their --nproc-per-node is the lowest-numbered joined node's of the first round (the coordinator
// has none to compare), published for the nodes that check later. The
// store's host stays the single point, as torchrun's c10d rendezvous host (whose answer is etcd):
// run it where nothing else fails, a head node.
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/launch/agent_store.h"
#include "dtrain/launch/allocator.h"
#include "dtrain/launch/env.h"
#include "dtrain/launch/options.h"
#include "dtrain/launch/prefixer.h"
#include "dtrain/launch/stall.h"
#include "dtrain/launch/workers.h"
#include "dtrain/launch/store_thread.h"

namespace dtrain::launch {

class StopSignals;
class WorkerGroup;

enum class AgentState {
  kRendezvous,    // waiting for every node's agent to join the current round
  kRunning,       // this node's workers run; watching them, the other nodes and the signals
  kCoordinating,  // (a coordinator node 0, no workers) watching the round's nodes until it ends
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
  void begin_round();  // a round's own bookkeeping cleared
  // --nnodes MIN:MAX (agent_rendezvous.cpp): the round's members, decided by node 0.
  void elastic_rendezvous();
  bool elastic_join();
  void stop_in_rendezvous(int sig = 0);
  void failed_before_start(const RoundFailure& f);
  void end_on_lost_store(const std::exception& e);
  void check_settings();
  void become_member(const std::vector<int>& members, int restarts);
  void close_when_due(int round, int joined, std::optional<std::chrono::steady_clock::time_point>& quorum_at);
  struct ElasticSeen;
  int group_rank() const;  // this node's index among the round's members
  std::string ranks_here() const;  // "rank 2" or "ranks 2-3"
  // The failure for members whose dtrun stopped responding: restartable while MIN members are left.
  RoundFailure lost_nodes(const std::vector<int>& stale) const;
  // --keep-survivors (agent_survivors.cpp): whether the failed worker was taken: declared dead to
  // the others (a replacement started with --max-restarts), or, this node's last worker, the node
  // finishing while the others go on (one more lost on the way when it had left itself out after
  // its peers finished). False: the round fails as without the flag (a single node's last worker,
  // or the workers asked for a restart: elastic/restart).
  bool keep_survivor_of_failure();
  void start_replacement(const WorkerExit& failed);
  // The reason the workers gave for a restart instead of going on in process (nullopt: none).
  std::optional<std::string> restart_requested();
  bool marked_dead(int rank);  // worker `rank` is dead to the workers of this round (elastic/dead)
  void declare_dead(int rank, const std::string& why);
  // Nodes gone silent: their ranks declared dead, no longer watched; the workers here go on.
  void keep_survivors_of_lost_nodes(const std::vector<int>& stale);
  // Node 0 (Design note [nodes joining in process]): admits the nodes waiting to join round_ + 1
  // into the running round while it has room.
  void admit_waiting_nodes();
  void watch_alive_members();
  // A node admitted into the running round `adm` (round, its workers' ids): becomes its member.
  void join_running_round(const std::pair<int, std::vector<int>>& adm);
  // This node's worker `local_rank` in the round (`extra`: variables set over the launcher's).
  WorkerSpec spec_for(int local_rank, const EnvMap& extra = {}) const;
  void running();
  // A coordinator's round (src/launch/agent_coordinator.cpp, Design note [a coordinator node]).
  void coordinating();
  // The workers a training node runs (a coordinator learns it from the nodes that joined).
  int workers_per_node() const;
  void stopping();
  void waiting_peers();
  void exit_barrier();

  void start_workers();
  void publish(const RoundFailure& failure);     // report to the store (the round's winner comes back later)
  void collect_reports();                        // takes the answers to finished reports
  void after_failure();                          // restart or finish, once workers are stopped
  void lost_store(const std::exception& e);
  bool take_stop_signal(int* sig);               // a new SIGINT/SIGTERM/... since the last call
  RoundFailure signal_failure(int sig) const;
  std::string describe(const RoundFailure& f) const;
  void wait_events(double seconds);              // sleeps, waking early for signals
  // A store call's answer, waited for while signals are watched (Design note [agents never wait
  // on the store]): nullopt as soon as a stop signal is pending (take it with take_stop_signal).
  // Throws what the call threw, or std::runtime_error when the store has not answered within
  // --heartbeat-timeout.
  template <class T>
  std::optional<T> await(std::future<T> answer);
  // What running() and stopping() learn from the store, polled every --monitor-interval.
  struct Poll {
    std::optional<RoundFailure> failure;  // the round's failure, if any
    std::vector<int> stale;               // nodes whose agent stopped responding
    int waiting = 0;                      // (node 0, elastic) nodes waiting to join the next round
    std::optional<int> all_done;          // (a coordinator) every member finished the round: the job's code
  };
  std::future<Poll> start_poll();
  // What a poll's news of the nodes means for the round (running(), coordinating()): with
  // --keep-survivors lost nodes are declared dead and waiting ones admitted (nullopt: the round
  // goes on) while MIN nodes are left (--nnodes MIN:MAX; a fixed --nnodes goes on with any); else a lost node or one waiting to join ends it (the
  // failure, not yet published).
  std::optional<RoundFailure> news_of_nodes(const Poll& p);
  // Takes a finished poll (nullopt when none finished), submitting the next one when due; a poll
  // unanswered for --heartbeat-timeout throws std::runtime_error (node 0's store is lost).
  std::optional<Poll> take_poll();
  // Whether the agents coordinate through the store: several nodes (and the store still there).
  // One node's supervision (signals, workers' exits, restarts, stalls) never touches the store;
  // several nodes' calls it through calls_, never waiting on it; so a stalled or hostile store
  // client cannot delay it (Design notes [control plane], [agents never wait on the store]).
  bool coordinates() const { return options_.nnodes > 1 && store_ok_; }

  LaunchOptions options_;
  AgentOutput output_;
  std::string program_;
  AllocatorChoice allocator_;                  // --allocator, resolved (launch/allocator.h)
  std::vector<std::vector<int>> core_runs_;    // --bind-cores: local rank -> its cores (empty: unbound)
  // Resolves --allocator and --bind-cores and says what the workers get (once).
  void place_workers();
  std::vector<std::string> base_env_;
  AgentState state_ = AgentState::kRendezvous;
  int round_ = 0;
  std::string failed_;  // --keep-survivors: the ranks lost while the others went on ("2, 5")
  std::vector<int> lost_nodes_;  // --keep-survivors: nodes gone silent while the others went on
  int left_code_ = 0;  // --keep-survivors: the exit code of this node's last worker when all failed
  int restarts_used_ = 0;     // restarts after failures (--max-restarts); membership changes do not count
  int replaced_in_round_ = 0;  // --keep-survivors: replacements started in this round (given back when it restarts refused)
  std::vector<int> members_;  // the round's nodes (every node 0..nnodes-1 unless elastic)
  std::vector<int> joined_in_process_;  // (node 0) nodes admitted into a running round that were not its members
  std::vector<int> admitted_ids_;       // this node's workers' ids when it was admitted into a running round
  std::vector<std::string> left_out_said_;  // (node 0) the joined nodes left out of rounds, as logged
  bool started_ = false;      // (elastic) joined a first round
  bool was_member_ = false;   // (elastic) a member of some round: a stop signal then stops the job
  int exit_code_ = 0;
  RoundFailure failure_;  // the current round's failure (valid in kStopping and after)
  bool store_ok_ = true;
  int stops_seen_ = 0;
  std::unique_ptr<StopSignals> signals_;
  std::unique_ptr<AgentStore> store_;
  // Several nodes: every store call runs on calls_ (Design note [agents never wait on the store]).
  std::unique_ptr<StoreThread> calls_;
  std::vector<std::future<RoundFailure>> reports_;  // published failures, not yet answered
  std::future<bool> reports_done_;                  // this node's "all workers exited 0"
  std::future<Poll> poll_;
  std::chrono::steady_clock::time_point poll_started_{}, next_poll_{};
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
