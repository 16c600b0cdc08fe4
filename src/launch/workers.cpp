#include "dtrain/launch/workers.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <sstream>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dtrain/launch/env.h"
#include "dtrain/launch/options.h"
#include "dtrain/launch/signals.h"

namespace dtrain::launch {

using Clock = std::chrono::steady_clock;

namespace {

// After every process is gone, how long to wait for the pipes to close (a process that left its
// process group may still hold them).
constexpr std::chrono::milliseconds kDrainTimeout{1000};
// After SIGKILL, how long to wait for process groups to empty before giving up on them.
constexpr std::chrono::milliseconds kKillTimeout{3000};

std::string format_seconds(std::chrono::milliseconds ms) {
  std::ostringstream s;
  s << static_cast<double>(ms.count()) / 1000.0 << " s";
  return s.str();
}

// Async-signal-safe helpers for the child between fork() and execve().
void child_write(const char* s) {
  ssize_t ignored = write(2, s, strlen(s));
  (void)ignored;
}

const char* errno_text(int e) {
  switch (e) {
    case ENOENT: return "No such file or directory";
    case EACCES: return "Permission denied";
    case ENOEXEC: return "Exec format error";
    case E2BIG: return "Argument list too long";
    case ENOMEM: return "Out of memory";
    case ETXTBSY: return "Text file busy";
    case EISDIR: return "Is a directory";
    case ELOOP: return "Too many levels of symbolic links";
    default: return "exec failed";
  }
}

[[noreturn]] void child_exec(pid_t parent, const char* path, char* const* argv, char* const* envp,
                             int in_fd, int out_fd, int err_fd, const cpu_set_t* cores) {
  setpgid(0, 0);
  if (cores && sched_setaffinity(0, sizeof(cpu_set_t), cores) != 0) {  // (--bind-cores: Design note [ranks bound to cores])
    child_write("dtrun: cannot bind the worker to its cores (sched_setaffinity failed); it runs on dtrun's\n");
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(128 + SIGKILL);  // dtrun died before prctl took effect
  // dtrun's handlers must not run here before execve (it would reset them anyway); signals that
  // dtrun found ignored stay ignored; SIGPIPE (ignored by dtrun itself) goes back to default.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD}) {
    struct sigaction current {};
    if (sigaction(sig, nullptr, &current) == 0 && current.sa_handler != SIG_IGN) sigaction(sig, &dfl, nullptr);
  }
  sigaction(SIGPIPE, &dfl, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0) _exit(127);
  if (syscall(SYS_close_range, 3u, ~0u, 0u) != 0) {
    long max_fd = sysconf(_SC_OPEN_MAX);
    if (max_fd < 0 || max_fd > 65536) max_fd = 65536;
    for (int fd = 3; fd < max_fd; ++fd) close(fd);
  }
  execve(path, argv, envp);
  int e = errno;
  child_write("dtrun: cannot execute ");
  child_write(path);
  child_write(": ");
  child_write(errno_text(e));
  child_write("\n");
  _exit(e == ENOENT ? 127 : 126);
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

}  // namespace

// ---- WorkerExit ----

bool WorkerExit::failed() const {
  return !(WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0);
}

int WorkerExit::exit_code() const {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

std::string WorkerExit::describe() const {
  std::string who = "worker rank " + std::to_string(rank) + " (local " + std::to_string(local_rank) +
                    ", pid " + std::to_string(pid) + ")";
  if (WIFEXITED(wait_status)) return who + " exited with code " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    int sig = WTERMSIG(wait_status);
    std::string s = who + " was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
    if (WCOREDUMP(wait_status)) s += " (core dumped)";
    return s;
  }
  return who + " ended with wait status " + std::to_string(wait_status);
}

// ---- resolve_program ----

std::string resolve_program(const std::string& program, const std::string& path) {
  if (program.empty()) throw LaunchError("empty program name", 127);
  if (program.find('/') != std::string::npos) {
    if (!is_executable_file(program))
      throw LaunchError("program '" + program + "' is not an executable file", 127);
    return program;
  }
  std::string dirs = path.empty() ? "/usr/local/bin:/usr/bin:/bin" : path;
  size_t begin = 0;
  while (begin <= dirs.size()) {
    size_t end = dirs.find(':', begin);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(begin, end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (is_executable_file(candidate)) return candidate;
    begin = end + 1;
  }
  throw LaunchError("program '" + program + "' not found in PATH", 127);
}

// ---- WorkerGroup ----

struct WorkerGroup::Worker {
  Worker(const WorkerSpec& s, const Sink& out_sink, const Sink& err_sink, const std::string& prefix)
      : spec(s), out(prefix, out_sink), err(prefix, [this, err_sink, n = prefix.size()](std::string_view seg) {
          remember(seg.size() > n ? seg.substr(n) : seg);
          err_sink(seg);
        }) {}

  // Keeps the stderr lines that may explain a failure (see WorkerExit::last_error).
  void remember(std::string_view line) {
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
    if (line.empty()) return;
    std::string s(line.substr(0, 500));
    std::string lower = s;
    for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    // An uncaught exception's "what():" line, or a program's own "...: error: ..." report: the
    // latest of these wins; otherwise the latest line mentioning an error (backtrace frames such
    // as "c10::Error::Error(...)" only count there); otherwise the last line.
    if (lower.find("what():") != std::string::npos || lower.find(": error:") != std::string::npos) {
      report_line = s;
    } else if (lower.find("error") != std::string::npos) {
      error_line = s;
    }
    last_line = s;
  }
  std::string report_line, error_line, last_line;

  WorkerSpec spec;
  pid_t pid = -1;  // also the process group id
  bool reaped = false;
  int wait_status = 0;
  bool group_alive = true;
  int out_fd = -1;
  int err_fd = -1;
  OutputPrefixer out;
  OutputPrefixer err;

  WorkerExit exit_info() const {
    return WorkerExit{spec.local_rank, spec.rank, pid, wait_status,
                      !report_line.empty() ? report_line : !error_line.empty() ? error_line : last_line};
  }
  std::string name() const {
    return "worker rank " + std::to_string(spec.rank) + " (local " + std::to_string(spec.local_rank) +
           ", pid " + std::to_string(pid) + ")";
  }
};

WorkerGroup::WorkerGroup(Sink out, Sink err, Log log, std::chrono::milliseconds term_timeout)
    : out_(std::move(out)), err_(std::move(err)), log_(std::move(log)), term_timeout_(term_timeout) {}

WorkerGroup::~WorkerGroup() {
  bool running = std::any_of(workers_.begin(), workers_.end(), [](auto& w) { return !w->reaped; });
  if (running) {
    kill_groups(SIGKILL);
    for (auto& w : workers_)
      if (!w->reaped && w->pid > 0) waitpid(w->pid, &w->wait_status, 0);
  }
  for (auto& w : workers_) {
    if (w->out_fd >= 0) close(w->out_fd);
    if (w->err_fd >= 0) close(w->err_fd);
  }
}

void WorkerGroup::spawn(const std::string& program, std::vector<char*>& c_argv, const WorkerSpec& spec, int devnull) {
  auto w = std::make_unique<Worker>(
      spec, [this](std::string_view seg) { out_buf_.append(seg); },
      [this](std::string_view seg) { err_buf_.append(seg); }, output_prefix(spec.rank));
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) throw LaunchError(std::string("pipe2: ") + std::strerror(errno));
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    int e = errno;
    close(out_pipe[0]);
    close(out_pipe[1]);
    throw LaunchError(std::string("pipe2: ") + std::strerror(e));
  }
  auto c_env = c_strings(spec.env);
  cpu_set_t cores;
  CPU_ZERO(&cores);
  for (int c : spec.cores) CPU_SET(c, &cores);
  // Block every signal across fork() so the child never runs dtrun's handlers.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t self = getpid();
  pid_t pid = fork();
  if (pid == 0) child_exec(self, program.c_str(), c_argv.data(), c_env.data(), devnull, out_pipe[1], err_pipe[1],
                            spec.cores.empty() ? nullptr : &cores);
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (pid < 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    throw LaunchError(std::string("fork failed: ") + std::strerror(fork_errno));
  }
  setpgid(pid, pid);  // also done by the child; whichever runs first wins, both agree
  w->pid = pid;
  w->out_fd = out_pipe[0];
  w->err_fd = err_pipe[0];
  fcntl(w->out_fd, F_SETFL, fcntl(w->out_fd, F_GETFL) | O_NONBLOCK);
  fcntl(w->err_fd, F_SETFL, fcntl(w->err_fd, F_GETFL) | O_NONBLOCK);
  workers_.push_back(std::move(w));
}

void WorkerGroup::start(const std::string& program, const std::vector<std::string>& argv,
                        const std::vector<WorkerSpec>& specs) {
  if (phase_ != Phase::kIdle) throw std::logic_error("WorkerGroup::start called twice");
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw LaunchError(std::string("cannot open /dev/null: ") + std::strerror(errno));
  auto c_argv = c_strings(argv);
  phase_ = Phase::kRunning;
  try {
    for (const auto& spec : specs) spawn(program, c_argv, spec, devnull);
  } catch (...) {
    close(devnull);
    kill_groups(SIGKILL);
    for (auto& w : workers_)
      if (!w->reaped) waitpid(w->pid, &w->wait_status, 0), w->reaped = true;
    close_pipes();
    phase_ = Phase::kDone;
    throw;
  }
  close(devnull);
}

void WorkerGroup::add(const std::string& program, const std::vector<std::string>& argv, const WorkerSpec& spec) {
  if (phase_ != Phase::kRunning) throw std::logic_error("WorkerGroup::add while the group is not running");
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (devnull < 0) throw LaunchError(std::string("cannot open /dev/null: ") + std::strerror(errno));
  auto c_argv = c_strings(argv);
  try {
    spawn(program, c_argv, spec, devnull);
  } catch (...) {
    close(devnull);
    throw;
  }
  close(devnull);
}

void WorkerGroup::poll(std::chrono::milliseconds timeout, const std::vector<int>& wake_fds) {
  if (phase_ == Phase::kIdle || phase_ == Phase::kDone) return;
  auto now = Clock::now();
  auto until = [&](Clock::time_point t) {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(t - now) + std::chrono::milliseconds(1));
  };
  if (phase_ == Phase::kStopping && !killed_) timeout = std::min(timeout, until(kill_at_));
  if (phase_ == Phase::kStopping && killed_) timeout = std::min(timeout, until(kill_at_ + kKillTimeout));
  if (phase_ == Phase::kDraining) timeout = std::min(timeout, until(drain_until_));

  std::vector<pollfd> fds;
  for (auto& w : workers_) {
    if (w->out_fd >= 0) fds.push_back({w->out_fd, POLLIN, 0});
    if (w->err_fd >= 0) fds.push_back({w->err_fd, POLLIN, 0});
  }
  for (int fd : wake_fds) fds.push_back({fd, POLLIN, 0});
  int n = ::poll(fds.data(), fds.size(), static_cast<int>(timeout.count()));
  std::vector<int> readable;
  if (n > 0)
    for (auto& p : fds)
      if (p.revents & (POLLIN | POLLHUP | POLLERR)) readable.push_back(p.fd);
  read_pipes(readable);
  reap();
  advance();
}

void WorkerGroup::read_pipes(const std::vector<int>& readable) {
  char buf[65536];
  for (auto& w : workers_) {
    for (int* fd : {&w->out_fd, &w->err_fd}) {
      if (*fd < 0 || std::find(readable.begin(), readable.end(), *fd) == readable.end()) continue;
      OutputPrefixer& prefixer = (fd == &w->out_fd) ? w->out : w->err;
      // Read what is there (bounded, so one chatty worker cannot starve the loop).
      for (int round = 0; round < 16; ++round) {
        ssize_t got = read(*fd, buf, sizeof buf);
        if (got > 0) {
          prefixer.feed(std::string_view(buf, static_cast<size_t>(got)));
          if (out_buf_.size() + err_buf_.size() > (1 << 20)) flush_output();
          continue;
        }
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && errno == EAGAIN) break;
        prefixer.finish();  // EOF or a read error: the stream is over
        close(*fd);
        *fd = -1;
        break;
      }
    }
  }
  flush_output();
}

void WorkerGroup::flush_output() {
  if (!out_buf_.empty()) out_(out_buf_);
  if (!err_buf_.empty()) err_(err_buf_);
  out_buf_.clear();
  err_buf_.clear();
}

void WorkerGroup::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      if (pid < 0 && errno == EINTR) continue;
      return;  // nothing more now (0), or no children at all (ECHILD)
    }
    for (auto& w : workers_) {
      if (w->pid != pid || w->reaped) continue;
      w->reaped = true;
      w->wait_status = status;
      // What it wrote before it ended is in its pipes: read it now, so that its last error line
      // is known (and printed) before the failure is reported.
      read_pipes({w->out_fd, w->err_fd});
      WorkerExit e = w->exit_info();
      if (phase_ == Phase::kRunning && e.failed()) {
        if (!first_failure_) {
          first_failure_ = e;
        } else {
          later_failures_.push_back(e);
        }
      }
    }
    // Other pids are orphans adopted by dtrun (a child subreaper): reaped and forgotten.
  }
}

std::vector<pid_t> WorkerGroup::adopted_children() const {
  std::vector<pid_t> out;
  const pid_t self = getpid();
  DIR* proc = opendir("/proc");
  if (!proc) return out;
  while (dirent* e = readdir(proc)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    std::ifstream stat("/proc/" + std::string(e->d_name) + "/stat");
    std::string text;
    std::getline(stat, text);
    auto paren = text.rfind(')');  // "pid (comm) state ppid ...": comm may contain anything
    if (paren == std::string::npos) continue;
    std::istringstream rest(text.substr(paren + 1));
    std::string state;
    long ppid = 0;
    if (!(rest >> state >> ppid) || ppid != self) continue;
    bool is_worker = std::any_of(workers_.begin(), workers_.end(), [&](auto& w) { return w->pid == pid; });
    bool spared = std::find(spared_.begin(), spared_.end(), pid) != spared_.end();
    if (!is_worker && !spared) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(proc);
  return out;
}

bool WorkerGroup::anything_left() {
  bool alive = false;
  for (auto& w : workers_) {
    if (!w->group_alive) continue;
    if (kill(-w->pid, 0) != 0 && errno == ESRCH) w->group_alive = false;
    else alive = true;
  }
  return alive || !adopted_children().empty();
}

void WorkerGroup::kill_groups(int sig) {
  for (auto& w : workers_) {
    if (!w->group_alive || w->pid <= 0) continue;
    if (kill(-w->pid, sig) != 0 && errno == ESRCH) {
      if (!w->reaped) kill(w->pid, sig);  // not yet in its own group (just forked)
      else w->group_alive = false;
    }
  }
  for (pid_t orphan : adopted_children()) {
    kill(orphan, sig);
    signalled_orphans_.insert(orphan);
  }
}

void WorkerGroup::close_pipes() {
  for (auto& w : workers_) {
    if (w->out_fd >= 0) w->out.finish(), close(w->out_fd), w->out_fd = -1;
    if (w->err_fd >= 0) w->err.finish(), close(w->err_fd), w->err_fd = -1;
  }
  flush_output();
}

void WorkerGroup::stop(int sig, std::chrono::milliseconds grace) {
  if (phase_ == Phase::kIdle || phase_ == Phase::kDraining || phase_ == Phase::kDone) return;
  auto now = Clock::now();
  if (phase_ == Phase::kStopping) {
    if (now + grace < kill_at_ && !killed_) {
      kill_at_ = now + grace;
      grace_ = grace;
    }
    if (sig != SIGKILL || killed_) return;
  }
  stop_signal_ = sig;
  grace_ = grace;
  kill_at_ = now + grace;
  phase_ = Phase::kStopping;
  kill_groups(sig);
  if (sig == SIGKILL) killed_ = true;
}

void WorkerGroup::advance() {
  const auto now = Clock::now();
  const bool all_reaped = std::all_of(workers_.begin(), workers_.end(), [](auto& w) { return w->reaped; });
  switch (phase_) {
    case Phase::kIdle:
    case Phase::kDone:
      return;
    case Phase::kRunning:
      if (!all_reaped) return;
      if (anything_left()) {
        log_("every worker exited; stopping the processes they left behind");
        stop(SIGTERM, term_timeout_);
        return;
      }
      break;
    case Phase::kStopping:
      if (!killed_ && now >= kill_at_) {
        for (auto& w : workers_) {
          if (!w->reaped)
            log_(w->name() + " did not exit within " + format_seconds(grace_) + " after " +
                 signal_name(stop_signal_) + "; sending SIGKILL");
          else if (w->group_alive)
            log_("processes left by " + w->name() + " did not exit within " + format_seconds(grace_) +
                 " after " + signal_name(stop_signal_) + "; sending SIGKILL");
        }
        signalled_orphans_.clear();  // SIGKILL goes to every adopted process now
        kill_groups(SIGKILL);
        killed_ = true;
      }
      for (pid_t orphan : adopted_children())  // re-parented to dtrun since the last signal
        if (signalled_orphans_.insert(orphan).second) kill(orphan, killed_ ? SIGKILL : stop_signal_);
      if (!all_reaped) return;
      if (anything_left()) {
        if (!(killed_ && now >= kill_at_ + kKillTimeout)) return;
        log_("some processes of the workers are still there " + format_seconds(kKillTimeout) + " after SIGKILL; giving up on them");
      }
      break;
    case Phase::kDraining: {
      bool open = std::any_of(workers_.begin(), workers_.end(),
                              [](auto& w) { return w->out_fd >= 0 || w->err_fd >= 0; });
      if (open && now < drain_until_) return;
      close_pipes();
      phase_ = Phase::kDone;
      return;
    }
  }
  // Every worker is reaped and its process group is empty: forward what is left in the pipes.
  phase_ = Phase::kDraining;
  drain_until_ = now + kDrainTimeout;
  advance();
}

void WorkerGroup::accept_failure() {
  first_failure_.reset();
  if (!later_failures_.empty()) {  // (reaped together with the accepted one: reported next)
    first_failure_ = later_failures_.front();
    later_failures_.erase(later_failures_.begin());
  }
  reap();
}

int WorkerGroup::running() const {
  return static_cast<int>(std::count_if(workers_.begin(), workers_.end(), [](auto& w) { return !w->reaped; }));
}

int WorkerGroup::succeeded() const {
  return static_cast<int>(
      std::count_if(workers_.begin(), workers_.end(), [](auto& w) { return w->reaped && !w->exit_info().failed(); }));
}

bool WorkerGroup::all_succeeded() const {
  return !workers_.empty() && std::all_of(workers_.begin(), workers_.end(), [](auto& w) {
    return w->reaped && !w->exit_info().failed();
  });
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> out;
  for (auto& w : workers_) out.push_back(w->pid);
  return out;
}

}  // namespace dtrain::launch
