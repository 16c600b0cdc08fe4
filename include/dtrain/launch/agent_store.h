#pragma once
// AgentStore: the agents' (one dtrun per node) meeting point, torchrun's "agent store".
//
// dtrun on node 0 hosts a c10d::TCPStore server at MASTER_ADDR:MASTER_PORT (port 0: the kernel
// picks a free one; port() tells which); the other nodes' dtrun and every worker connect to it as
// clients. Workers use keys under "/worker/attempt_<restart>/" (the library's business); the
// agents use keys under "dtrun/":
//
//   dtrun/rdzv/<round>/claim/<node>    counter; > 1 means two agents use the same --node-rank
//   dtrun/rdzv/<round>/config/<node>   the node's settings, which must match everywhere (a
//                                      coordinator's nproc-per-node=0 excepted)
//   dtrun/rdzv/<round>/joined          counter of agents that joined round <round>
//   dtrun/round/<round>/failure        the round's first failure (RoundFailure::encode), first
//                                      writer wins (compareSet)
//   dtrun/abort                        a failure that ends the job on every node (no restart)
//   dtrun/round/<round>/done           counter of nodes finished with the round (all exited 0, or
//                                      under --keep-survivors all failed)
//   dtrun/round/<round>/done/<node>    the code the node ends with (0, or its last worker's)
//   dtrun/hb/<node>                    heartbeat counter, bumped about once a second
//   dtrun/exit/<node>                  set when the node's agent has seen the final outcome
//   dtrun/rdzv/<round>/members         --nnodes MIN:MAX: the round's nodes ("0,2,3"), set by node 0
//                                      when it closes the round (Design note [elastic membership])
//   dtrun/rdzv/<round>/restarts        the restarts the job had used when node 0 closed the round
//   dtrun/newest                       the newest closed round (where a node starting late joins)
//   dtrun/settings                     node 0's settings (an elastic node checks its own first)
//   dtrun/workers-per-node             (a coordinator node 0) the training nodes' --nproc-per-node
//   /worker/attempt_<round>/dtrain/elastic/{dead/<rank>,failures,restart}: the workers' keys that
//                                      dtrun --keep-survivors writes (dead, failures) and reads
//                                      (dead, restart: train::Elastic::request_restart)
//
// Every call is a short request to the store; waiting is the agent's job (it polls, so that it
// stays responsive to signals and its workers). Store errors surface as std::exception.
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dtrain/launch/options.h"
#include "dtrain/launch/store_server.h"

namespace dtrain::launch {

// Why a round ended early, as every agent sees it.
struct RoundFailure {
  int node = -1;            // the node that reported it
  int exit_code = 1;        // what dtrun exits with if no restart follows
  bool restartable = true;  // false: a stop request (signal) or a lost agent; never restarted
  std::string what;         // "worker rank 3 (local 1, pid 1234) exited with code 3"
  bool membership = false;  // a node asks to join an elastic job: restarted without counting a restart

  std::string encode() const;
  static RoundFailure decode(const std::string& text);
};

class AgentStore {
 public:
  // Node 0: starts the store server. Other nodes: waits (up to options.rdzv_timeout_s, probing
  // every 100 ms, giving up early when `interrupted()` turns true) for node 0's store and connects.
  // Throws LaunchError with a clear message when that fails.
  AgentStore(const LaunchOptions& options, const std::function<bool()>& interrupted);
  ~AgentStore();

  int port() const { return port_; }
  // Node 0: the store server's process (-1 elsewhere).
  pid_t server_pid() const { return server_ ? server_->pid() : -1; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // ---- rendezvous of the agents, once per round ----
  void join(int round);
  // True once every node joined `round`; then also checks that all nodes' settings agree
  // (throws LaunchError naming the first difference).
  bool all_joined(int round);
  std::vector<int> missing_nodes(int round);

  // ---- elastic membership (--nnodes MIN:MAX: Design note [elastic membership], agent.h) ----
  int joined_count(int round);
  // The nodes that joined `round` with this node's settings, and what differs for the others (a
  // coordinator, which has no workers, takes the lowest-numbered joined node's --nproc-per-node for the
  // job's and holds the others to it: workers_per_node()).
  std::pair<std::vector<int>, std::vector<std::string>> joined_nodes(int round);
  // The workers a training node runs: this node's --nproc-per-node, or a coordinator's learned one
  // (0 before a node joined).
  int workers_per_node() const { return workers_per_node_.load(); }
  // Node 0: closes `round` with `members` (and the restarts the job has used) and records it as the
  // newest closed round.
  void close_round(int round, const std::vector<int>& members, int restarts);
  std::optional<std::vector<int>> members(int round);
  int restarts_of(int round);
  std::optional<int> newest_round();
  // Node 0 publishes its settings; another node's settings_mismatch() says how they differ from
  // its own (nullopt: the same, or not published yet).
  void publish_settings();
  // dtrun --keep-survivors: tells the workers of restart `round` that `rank` is dead (Design note
  // [in-process recovery], train/elastic.h: elastic/dead/<rank>, then elastic/failures).
  void declare_dead(int round, int rank, const std::string& why);
  // The workers of restart `round` cannot go on in process (elastic/restart: train::Elastic::
  // request_restart): the reason, or nullopt.
  std::optional<std::string> restart_requested(int round);
  bool marked_dead(int round, int rank);  // elastic/dead/<rank> of restart `round`
  // --keep-survivors with --nnodes MIN:MAX (Design note [nodes joining in process], agent.h): node
  // 0 admits `node`, waiting to join round + 1, into the running `round` with its workers' `ids`;
  // its join of round + 1 is undone; the node reads its admission (nullopt: none yet) as (round, ids)
  void admit(int round, int node, const std::vector<int>& ids);
  // (read once) and, lost before it read it, node 0 forgets it.
  std::optional<std::pair<int, std::vector<int>>> admission(int next_round);
  void forget_admission(int round, int node);
  int next_replacement();  // 1, 2, ...: the job's count of replacement workers
  void record_replacement(int node, int id);  // replacement `id` runs on `node`
  std::vector<int> replacements_on(int node);  // the ids recorded for `node`
  // --keep-survivors: the watched nodes that neither finished `round` nor left the job.
  std::vector<int> not_finished(int round);
  std::optional<std::string> settings_mismatch();
  // The nodes heartbeat() and not_yet_exited() look at (default: every node 0..nnodes-1).
  void watch(std::vector<int> nodes) { watched_ = std::move(nodes); }

  // ---- failures: the first report of a round wins; returns the winner. A non-restartable
  // failure (stop request, lost agent) overrides every round's record: the job ends. ----
  RoundFailure report_failure(int round, const RoundFailure& failure);
  std::optional<RoundFailure> failure(int round);

  // ---- success of a round: every node reports when all its workers exited 0 ----
  // (`exit_code`: what the node exits with, not 0 under --keep-survivors when its workers all failed)
  void report_done(int round, int exit_code = 0);
  // (a coordinator) what the job ends with once every watched node finished `round`: 0 when a node
  // ended 0, else the first node's code.
  int finished_code(int round);
  int done_count(int round);

  // ---- liveness ----
  // Bumps this node's heartbeat (at most about once a second) and returns the nodes whose
  // heartbeat has not moved for `timeout` (nodes that already left through the exit barrier
  // and nodes never seen are not reported).
  std::vector<int> heartbeat(std::chrono::milliseconds timeout);

  // ---- exit barrier: node 0 keeps the store up until every agent has seen the outcome ----
  void arrive_exit();
  std::vector<int> not_yet_exited();

 private:
  // "nproc-per-node=P nnodes=... ...": what every node must agree on; P is compared among the
  // training nodes (a coordinator's 0 is not).
  std::string config_string() const;
  std::string elastic_prefix(int round) const;  // the workers' elastic/ keys of restart `round`

  LaunchOptions options_;
  std::atomic<int> workers_per_node_{0};  // (set on the store thread, read on the agent's)
  std::unique_ptr<StoreServer> server_;  // node 0: the server's own process (Design note [store server process])
  int port_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;
  struct Beat {
    int64_t value = -1;
    std::chrono::steady_clock::time_point changed;
  };
  std::map<int, Beat> beats_;
  std::vector<int> watched_;
  std::chrono::steady_clock::time_point last_beat_{};
};

// Waits until a TCP connection to host:port succeeds. Returns false on timeout or interruption.
bool wait_for_listener(const std::string& host, int port, std::chrono::milliseconds timeout,
                       const std::function<bool()>& interrupted, std::string* last_error);

}  // namespace dtrain::launch
