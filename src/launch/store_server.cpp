#include "dtrain/launch/store_server.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/compat.h"
#include "dtrain/launch/bind_restriction.h"
#include "dtrain/launch/options.h"

namespace dtrain::launch {

using Clock = std::chrono::steady_clock;

namespace {

void write_line(int fd, const std::string& line) {
  std::string s = line + "\n";
  const char* p = s.data();
  size_t left = s.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

// Every descriptor but 0, 1, 2 and `keep`: the child holds nothing of dtrun's (its signal pipe,
// a terminal's or a test's pipes beyond the standard ones).
void close_other_fds(int keep_a, int keep_b) {
  std::vector<int> fds;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    const int own = ::dirfd(d);
    while (dirent* e = ::readdir(d)) {
      char* end = nullptr;
      long fd = std::strtol(e->d_name, &end, 10);
      if (*end != '\0' || fd <= 2 || fd == own || fd == keep_a || fd == keep_b) continue;
      fds.push_back(static_cast<int>(fd));
    }
    ::closedir(d);
  }
  for (int fd : fds) ::close(fd);
}

// What this process has mapped, in bytes (/proc/self/statm's first field).
size_t mapped_bytes() {
  size_t pages = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%zu", &pages) != 1) pages = 0;
    std::fclose(f);
  }
  return pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

// The child: Design note [store server process].
[[noreturn]] void serve(const std::string& host, int port, std::chrono::milliseconds timeout, int report,
                        int lifeline, pid_t parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(0);
  ::prctl(PR_SET_NAME, "dtrun-store");
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGPIPE}) std::signal(sig, SIG_IGN);
  std::signal(SIGCHLD, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  close_other_fds(report, lifeline);
  if (int null = ::open("/dev/null", O_RDONLY); null >= 0) {
    ::dup2(null, 0);
    if (null != 0) ::close(null);
  }
  rlimit limit{};
  limit.rlim_cur = limit.rlim_max = mapped_bytes() + kStoreMemoryHeadroom;
  ::setrlimit(RLIMIT_AS, &limit);
  limit_accepted_sockets(kStoreSocketTimeout);

  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    BindRestriction only_there(host);  // Design note [control plane]
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(port);
    o.isServer = true;
    o.numWorkers = c10::nullopt;
    o.waitWorkers = false;
    o.timeout = timeout;
    o.multiTenant = false;
    store = compat::make_tcp_store(host, o);
    if (!only_there.applied()) {
      std::cerr << "dtrun: warning: the agent store could not be kept to " << host
                << " (this dtrun's bind() is not the one libtorch calls): it listens on every interface\n";
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    write_line(report, "error " + what.substr(0, what.find('\n')));
    ::_exit(1);
  }
  write_line(report, "ok " + std::to_string(store->getPort()));
  ::close(report);
  // Serve until dtrun closes its end (or dies: the kernel closes it, and PR_SET_PDEATHSIG).
  // _exit, not return: the server's daemon may be blocked by a client, and its destructor would
  // wait for it.
  for (;;) {
    char c;
    ssize_t n = ::read(lifeline, &c, 1);
    if (n == 0 || (n < 0 && errno != EINTR)) ::_exit(0);
  }
}

}  // namespace

StoreServer::StoreServer(const std::string& host, int port, std::chrono::milliseconds timeout,
                         const std::function<bool()>& interrupted) {
  int report[2], life[2];
  if (::pipe2(report, O_CLOEXEC) != 0) throw LaunchError(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(life, O_CLOEXEC) != 0) {
    ::close(report[0]);
    ::close(report[1]);
    throw LaunchError(std::string("pipe: ") + std::strerror(errno));
  }
  const pid_t parent = ::getpid();
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = ::fork();
  if (pid < 0) {
    for (int fd : {report[0], report[1], life[0], life[1]}) ::close(fd);
    throw LaunchError(std::string("cannot start the agent store's process (fork: ") + std::strerror(errno) + ")");
  }
  if (pid == 0) {
    ::close(report[0]);
    ::close(life[1]);
    serve(host, port, timeout, report[1], life[0], parent);
  }
  pid_ = pid;
  ::close(report[1]);
  ::close(life[0]);
  lifeline_ = life[1];

  // Its first line: "ok PORT" or "error WHAT".
  std::string line;
  const auto deadline = Clock::now() + timeout;
  bool eof = false;
  while (line.find('\n') == std::string::npos && !eof) {
    if (interrupted && interrupted()) break;
    if (Clock::now() >= deadline) break;
    pollfd p{report[0], POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char buf[512];
    ssize_t n = ::read(report[0], buf, sizeof buf);
    if (n > 0) line.append(buf, static_cast<size_t>(n));
    else if (n == 0 || errno != EINTR) eof = true;
  }
  ::close(report[0]);
  if (line.rfind("ok ", 0) == 0 && line.find('\n') != std::string::npos) {
    port_ = std::atoi(line.c_str() + 3);
    return;
  }
  stop();
  if (line.rfind("error ", 0) == 0) throw LaunchError(line.substr(6, line.find('\n') - 6));
  if (interrupted && interrupted()) throw LaunchError("interrupted while starting the agent store");
  if (!eof) throw LaunchError("the agent store's process did not start listening within its timeout");
  throw LaunchError("the agent store's process ended before it listened");
}

StoreServer::~StoreServer() { stop(); }

void StoreServer::stop() {
  if (lifeline_ >= 0) ::close(lifeline_);
  lifeline_ = -1;
  if (pid_ <= 0) return;
  // Still our unreaped child? (WorkerGroup's reap of adopted children may have reaped it, and
  // its pid may be anybody's now.)
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) == 0) {
    ::kill(pid_, SIGKILL);
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  pid_ = -1;
}

}  // namespace dtrain::launch
