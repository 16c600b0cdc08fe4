#include "dtrain/launch/signals.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

namespace dtrain::launch {
namespace {

int g_pipe[2] = {-1, -1};
volatile sig_atomic_t g_stop_count = 0;
volatile sig_atomic_t g_last_stop = 0;
volatile sig_atomic_t g_report_count = 0;  // SIGUSR1: print the stall report, end nothing
struct sigaction g_old_usr1;
std::atomic<bool> g_installed{false};

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
struct sigaction g_old[4];
struct sigaction g_old_chld;
struct sigaction g_old_pipe;

extern "C" void on_signal(int sig) {
  int saved = errno;
  if (sig == SIGUSR1) {
    g_report_count = g_report_count + 1;
  } else if (sig != SIGCHLD) {
    g_stop_count = g_stop_count + 1;
    g_last_stop = sig;
  }
  char c = static_cast<char>(sig);
  ssize_t ignored = write(g_pipe[1], &c, 1);  // full pipe: a wake-up is already pending
  (void)ignored;
  errno = saved;
}

}  // namespace

StopSignals::StopSignals() {
  if (g_installed.exchange(true)) throw std::logic_error("StopSignals: only one instance per process");
  if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("dtrun: pipe2 failed: ") + std::strerror(errno));
  g_stop_count = 0;
  g_last_stop = 0;
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int i = 0; i < 4; ++i) {
    sigaction(kStopSignals[i], nullptr, &g_old[i]);
    // Shell convention: SIGINT/SIGHUP/SIGQUIT ignored on entry (nohup, `cmd &` without job
    // control) stay ignored, for dtrun and its workers. SIGTERM is always handled.
    if (kStopSignals[i] != SIGTERM && g_old[i].sa_handler == SIG_IGN) continue;
    sigaction(kStopSignals[i], &sa, nullptr);
  }
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigaction(SIGCHLD, &sa, &g_old_chld);
  sigaction(SIGUSR1, &sa, &g_old_usr1);
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  sigaction(SIGPIPE, &ign, &g_old_pipe);
}

StopSignals::~StopSignals() {
  for (int i = 0; i < 4; ++i) sigaction(kStopSignals[i], &g_old[i], nullptr);
  sigaction(SIGCHLD, &g_old_chld, nullptr);
  sigaction(SIGUSR1, &g_old_usr1, nullptr);
  sigaction(SIGPIPE, &g_old_pipe, nullptr);
  close(g_pipe[0]);
  close(g_pipe[1]);
  g_pipe[0] = g_pipe[1] = -1;
  g_installed = false;
}

int StopSignals::fd() const { return g_pipe[0]; }

void StopSignals::drain() {
  char buf[256];
  while (read(g_pipe[0], buf, sizeof buf) > 0) {
  }
}

int StopSignals::stop_count() const { return g_stop_count; }
int StopSignals::last_stop_signal() const { return g_last_stop; }
int StopSignals::report_requests() const { return g_report_count; }

void with_signals_blocked(const std::function<void()>& fn) {
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : kStopSignals) sigaddset(&block, sig);
  sigaddset(&block, SIGCHLD);
  sigaddset(&block, SIGUSR1);
  sigaddset(&block, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  try {
    fn();
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGCHLD: return "SIGCHLD";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return "signal " + std::to_string(sig);
  }
}

}  // namespace dtrain::launch
