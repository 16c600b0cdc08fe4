#pragma once
// WorkerGroup: starts this node's workers and supervises them until every one is gone.
//
// - Each worker runs in its own process group (so stopping it also stops its children), with
//   PR_SET_PDEATHSIG=SIGKILL (if dtrun is SIGKILLed the worker dies too), stdin from /dev/null,
//   and stdout/stderr on pipes that dtrun forwards through an OutputPrefixer ("[rank]:").
// - stop(sig) sends `sig` to every worker's process group, and SIGKILL after the grace period.
// - When every worker has exited, whatever is left in their process groups (background children)
//   is stopped the same way. The launcher is expected to be a child subreaper
//   (PR_SET_CHILD_SUBREAPER, see Agent::run): descendants that left their worker's process group
//   (setsid) and lost their parent are re-parented to it, and are stopped too. Nothing outlives
//   the group, except what escapes both when dtrun itself is SIGKILLed.
// The group never blocks for long: poll() waits at most its timeout and then reports through
// phase(), first_failure() and all_succeeded().
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/launch/prefixer.h"

namespace dtrain::launch {

struct WorkerSpec {
  int local_rank = 0;
  int rank = 0;
  std::vector<std::string> env;  // the complete environment, "NAME=value"
  std::vector<int> cores;        // its affinity (empty: dtrun's own, inherited)
};

// How one worker ended.
struct WorkerExit {
  int local_rank = -1;
  int rank = -1;
  pid_t pid = -1;
  int wait_status = 0;  // as from waitpid()
  // The line of the worker's stderr that most likely says why it failed: the latest "what():" line
  // (an uncaught exception: std::terminate prints it) or "...: error: ..." report, else the last
  // line mentioning "error", else the last line; "" when it wrote nothing to stderr.
  std::string last_error;

  bool failed() const;     // non-zero exit code or killed by a signal
  int exit_code() const;   // the exit code, or 128 + signal number
  // "worker rank 1 (local 1, pid 1234) exited with code 3"
  // "worker rank 1 (local 1, pid 1234) was killed by signal 9 (SIGKILL)"
  std::string describe() const;
};

// Finds `program` as execvp would (a name with '/' is used as is, otherwise searched in `path`,
// the PATH value). Throws LaunchError with exit code 127 when there is no such executable.
std::string resolve_program(const std::string& program, const std::string& path);

class WorkerGroup {
 public:
  using Sink = OutputPrefixer::Sink;
  using Log = std::function<void(const std::string&)>;

  enum class Phase {
    kIdle,      // nothing started yet
    kRunning,   // workers are running and nobody asked them to stop
    kStopping,  // a stop signal went to every process group; SIGKILL follows at the deadline
    kDraining,  // every process is gone; forwarding the last output until the pipes close
    kDone,      // every worker reaped, every process group empty, all output forwarded
  };

  // out/err receive the prefixed output of the workers' stdout/stderr, whole segments only (many
  // per call: output is batched per poll() to keep the number of writes low); log gets dtrun's own
  // messages (without the "dtrun: " prefix). term_timeout is the grace period used for the
  // processes workers leave behind when they exit.
  WorkerGroup(Sink out, Sink err, Log log, std::chrono::milliseconds term_timeout);
  ~WorkerGroup();  // SIGKILLs and reaps whatever is still running
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts one process per spec running `program` (a path, see resolve_program) with `argv`
  // (argv[0] included). Throws LaunchError if a process cannot be created; the ones already
  // started are then killed.
  void start(const std::string& program, const std::vector<std::string>& argv,
             const std::vector<WorkerSpec>& specs);

  // One more worker while the group runs (dtrun --keep-survivors: a replacement for a failed one).
  void add(const std::string& program, const std::vector<std::string>& argv, const WorkerSpec& spec);

  // Forwards output, reaps exited workers and sends SIGKILL when a stop's grace period is over.
  // Returns after at most `timeout`, or earlier when something happened or one of `wake_fds`
  // became readable (the caller drains those).
  void poll(std::chrono::milliseconds timeout, const std::vector<int>& wake_fds = {});

  // Sends `sig` to every worker's process group now and SIGKILL to those still alive `grace`
  // later. A second call can only shorten the grace period.
  void stop(int sig, std::chrono::milliseconds grace);

  Phase phase() const { return phase_; }
  // The first worker that failed while the group was running (not because of stop()).
  const std::optional<WorkerExit>& first_failure() const { return first_failure_; }
  // dtrun --keep-survivors: the failure reported is accepted (the next one will be reported).
  void accept_failure();
  int running() const;  // workers not yet reaped
  int succeeded() const;  // workers reaped with code 0
  // Every worker exited with code 0 (meaningful once phase() is kDraining or kDone).
  bool all_succeeded() const;
  std::vector<pid_t> pids() const;
  // A child of dtrun that is none of the workers' business (the agent store's process, Design
  // note [store server process]): never counted as left behind, never signalled.
  void spare(pid_t pid) { spared_.push_back(pid); }

 private:
  struct Worker;
  void spawn(const std::string& program, std::vector<char*>& c_argv, const WorkerSpec& spec, int devnull);
  void read_pipes(const std::vector<int>& readable);
  void reap();
  void advance();
  void kill_groups(int sig);  // every worker's process group, and the adopted children
  bool anything_left();       // a worker's process group still has members, or orphans remain
  std::vector<pid_t> adopted_children() const;
  void close_pipes();
  void flush_output();

  Sink out_, err_;
  std::string out_buf_, err_buf_;  // whole prefixed segments not yet handed to out_/err_
  Log log_;
  std::vector<pid_t> spared_;
  std::chrono::milliseconds term_timeout_;
  Phase phase_ = Phase::kIdle;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::optional<WorkerExit> first_failure_;
  std::vector<WorkerExit> later_failures_;  // (while first_failure_ was set: accept_failure's next)
  std::set<pid_t> signalled_orphans_;
  int stop_signal_ = 0;
  bool killed_ = false;
  std::chrono::steady_clock::time_point kill_at_{};
  std::chrono::milliseconds grace_{0};
  std::chrono::steady_clock::time_point drain_until_{};
};

}  // namespace dtrain::launch
