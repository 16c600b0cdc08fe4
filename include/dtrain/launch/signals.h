#pragma once
// Signals seen by the launcher, turned into something a poll() loop can wait on (a self-pipe).
//
// StopSignals installs handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT (the launcher's "stop"
// requests: forwarded to the workers, then dtrun exits), SIGCHLD (a worker changed state) and
// SIGUSR1 (print what the ranks are doing), and
// ignores SIGPIPE (a closed stdout must not kill the launcher). SIGINT, SIGHUP and SIGQUIT that
// were ignored when dtrun started (nohup, `dtrun ... &` in a script) stay ignored, as shells do;
// workers then inherit that. One instance per process; the destructor restores the previous
// dispositions.
#include <csignal>
#include <functional>
#include <string>

namespace dtrain::launch {

class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Readable whenever a handled signal arrived since the last drain().
  int fd() const;
  // Empties the pipe (call after poll() reported fd() readable).
  void drain();
  // The number of stop signals (SIGINT/SIGTERM/SIGHUP/SIGQUIT) received so far, and the last one.
  int stop_count() const;
  int last_stop_signal() const;
  // SIGUSR1s received so far: each asks for a report of what the ranks are doing (launch/stall.h).
  int report_requests() const;
};

// Runs fn with StopSignals' signals blocked in the calling thread, so that threads fn starts (the
// TCPStore's daemons) inherit the blocked mask and the handlers always run on the main thread.
void with_signals_blocked(const std::function<void()>& fn);

// "SIGKILL", "SIGTERM", ... ("signal 42" for others).
std::string signal_name(int sig);

}  // namespace dtrain::launch
