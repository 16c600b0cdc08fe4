#pragma once
// dtrun's command line: torchrun's flags parsed into one validated options struct.
//
//   dtrun [--standalone] [--nnodes N] [--node-rank K] [--nproc-per-node P]
//         [--master-addr HOST] [--master-port PORT | --rdzv-endpoint HOST:PORT]
//         [--max-restarts R] [--term-timeout S] [--rdzv-timeout S] [--no-python]
//         [--] PROGRAM [ARGS...]
//
// Flags take `--flag value` or `--flag=value`; `_` and `-` are interchangeable in flag names
// (--nproc_per_node == --nproc-per-node), as in torchrun. Parsing stops at the first word that
// is not a flag (the program) or at `--`; everything after belongs to the program.
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::launch {

// A launcher failure with the exit code dtrun should end with (what() is the message).
class LaunchError : public std::runtime_error {
 public:
  explicit LaunchError(const std::string& message, int exit_code = 1)
      : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const noexcept { return exit_code_; }

 private:
  int exit_code_;
};

// A bad command line: dtrun prints the message and a hint to --help, and exits with code 2.
class UsageError : public LaunchError {
 public:
  explicit UsageError(const std::string& message) : LaunchError(message, 2) {}
};

// torchrun's default agent store port for multi-node runs (--master-port's default there).
inline constexpr int kDefaultMasterPort = 29500;
// torchrun's default port for --rdzv-endpoint HOST without a port.
inline constexpr int kDefaultRdzvPort = 29400;

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;     // the most nodes (MAX of --nnodes MIN:MAX)
  int min_nodes = 0;  // MIN of --nnodes MIN:MAX (0 until validate(): then nnodes unless a range was given)
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  // The agent store's port. 0: node 0 lets the store bind a free port (the kernel picks it, so
  // there is no race) and exports the real one. -1 (not given): validate() makes it 0 for a
  // single node and kDefaultMasterPort for several nodes.
  int master_port = -1;
  bool standalone = false;
  int max_restarts = 0;
  // A worker that fails leaves the others running (its death told to them through the store:
  // Design note [in-process recovery], train/elastic.h); for programs that recover in process
  // (dtrain-gpt --elastic); a node gone silent is declared dead the same way (a fixed --nnodes).
  bool keep_survivors = false;
  std::string allocator = "auto";   // --allocator: the workers' (launch/allocator.h)
  std::string bind_cores = "auto";  // --bind-cores on|off|auto (launch/cores.h)
  double term_timeout_s = 5.0;    // SIGTERM -> SIGKILL grace period when stopping workers
  double rdzv_timeout_s = 300.0;  // how long agents wait for each other (join, store connect)
  double heartbeat_timeout_s = 30.0;  // an agent silent this long counts as gone (multi-node)
  // --nnodes MIN:MAX: once MIN nodes joined a round, node 0 waits this long for more (fewer than
  // MAX) before it closes the round (torchrun's last_call_timeout). Design note [elastic membership].
  double rdzv_last_call_s = 5.0;
  double stall_timeout_s = 300.0;   // no rank progressing this long ends the round (0: never); launch/stall.h
  double monitor_interval_s = 0.1;  // how often the agent polls the store for other nodes' news
  // The job's secret (Design note [control plane]): made by dtrun with --standalone, else from
  // --job-secret-file or DTRAIN_JOB_SECRET (the same on every node); "" = none (an open store).
  std::string job_secret;
  std::string run_id = "none";    // TORCHELASTIC_RUN_ID (--rdzv-id); random with --standalone
  std::string role = "default";   // ROLE_NAME (--role)
  bool help = false;               // --help: print usage() and exit 0
  std::vector<std::string> command;  // the program and its arguments

  // Not flags: filled by the launcher from its surroundings.
  bool stdout_isatty = false;  // dtrun's stdout is a terminal -> DTRAIN_STDOUT_ISATTY=1

  int world_size() const { return nnodes * nproc_per_node; }
  bool elastic() const { return min_nodes > 0 && min_nodes < nnodes; }
  // Node 0 of an elastic job started with --nproc-per-node 0: it hosts the store and decides the
  // rounds but trains nothing, so every training node (numbered 1..MAX) can be lost (Design note
  // [a coordinator node], launch/agent.h).
  bool coordinator() const { return nproc_per_node == 0; }
};

// Parses dtrun's arguments (without argv[0]) and validates the result (see validate()).
// Throws UsageError with a message naming the offending flag. With --help the result has help
// set and nothing else is validated.
LaunchOptions parse_args(const std::vector<std::string>& args);

// The one place where options are checked for consistency; parse_args calls it. Throws
// UsageError. Also normalises: --standalone means one node on 127.0.0.1 with a free port.
void validate(LaunchOptions& options);

// The --help text.
std::string usage();

}  // namespace dtrain::launch
