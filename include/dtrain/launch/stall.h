#pragma once
// Stall detection of dtrun (--stall-timeout): notices when no local rank has made progress for a
// while and says, in one block, which rank is stuck and where.
//
// Design note [stall detection]
// -----------------------------
// Every worker keeps its flight recorder (comm/flight_recorder.h) in a file of dtrun's
// DTRAIN_FLIGHT_DIR, mapped shared, so dtrun reads each rank's recent operations without the
// rank's help: a stopped (SIGSTOP, debugger), spinning or deadlocked rank is described too.
// A rank makes progress in an interval when its recorder counter moved (an operation started or
// ended) or it used CPU (at least 5% of one core over the interval: computing, hashing a
// checkpoint, loading data). So a long legitimate step (a slow first step, a big save on rank 0
// while the others wait in a barrier) is not a stall while some rank works; ranks that all wait in
// collectives, or are stopped, are. When no rank made progress for the timeout, report() reads
// every rank's state (/proc: running, sleeping, stopped), CPU time, last step and recent
// operations, and names the cause: stopped ranks; ranks that disagree (rank 1 in all_gather #518
// of group world while ranks 0, 2 are in all_reduce #517); ranks that never reached the operation
// the others wait in (computing or stuck outside communication). dtrun then ends the round like a
// failed worker (restarted under --max-restarts); SIGUSR1 prints the same report without ending
// anything. With several nodes each agent watches and reports its own ranks.
#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace dtrain::launch {

struct WatchedRank {
  int rank = 0;   // global rank
  pid_t pid = 0;
};

class StallMonitor {
 public:
  // `flight_dir`: where the workers' recorder files are (DTRAIN_FLIGHT_DIR); `timeout_s` > 0.
  StallMonitor(std::string flight_dir, double timeout_s);

  // Samples every rank (call it about once a second); true once none made progress for the timeout.
  bool stalled(const std::vector<WatchedRank>& ranks);
  // Forgets the history (a new round of workers).
  void reset();
  // One block: each rank's state, CPU, step and last operations, then the diagnosis.
  std::string report(const std::vector<WatchedRank>& ranks) const;
  double seconds_without_progress() const;

 private:
  struct Seen {
    unsigned long long events = 0;
    double cpu_s = -1;
  };
  std::string dir_;
  double timeout_s_;
  std::map<int, Seen> seen_;
  std::chrono::steady_clock::time_point last_progress_, last_sample_;
};

// From /proc/<pid>/stat: the process state letter ('R', 'S', 'D', 'T', 't', 'Z'; '?' if gone) and
// its CPU time (user + system, seconds; -1 if gone).
char process_state(pid_t pid, double* cpu_s);

}  // namespace dtrain::launch
