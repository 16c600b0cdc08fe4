// launch_ranks (testing.h): W ranks of a program without dtrun (Design note [test launches]).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/launch/allocator.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

namespace dtrain::testing {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("launch_ranks: no free port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

namespace {

struct Rank {
  pid_t pid = -1;
  int fd = -1;          // its stdout and stderr
  std::string partial;  // an unfinished line
  bool running = true;
};

}  // namespace

namespace {
// What dtrun's default (--allocator auto) would preload for these ranks, as dtrun's place_workers
// chooses it: nothing where the test's environment already preloads something.
launch::EnvMap default_allocator_env() {
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload && *preload) return {};
  return launch::allocator_env(launch::choose_allocator("auto", [](const std::string& p) { return util::fs::exists(p); }), "");
}
}  // namespace

CommandResult launch_ranks(const std::string& command, int world, int timeout_s) {
  const int port = free_port();
  const launch::EnvMap allocator = default_allocator_env();
  std::vector<Rank> ranks(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (::pipe(p) != 0) throw std::runtime_error("launch_ranks: pipe failed");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(p[1], 1);
      ::dup2(p[1], 2);
      ::close(p[0]);
      ::close(p[1]);
      const std::string w = std::to_string(world), rank = std::to_string(r);
      for (const auto& [k, v] : std::vector<std::pair<const char*, std::string>>{
               {"RANK", rank}, {"LOCAL_RANK", rank}, {"WORLD_SIZE", w}, {"LOCAL_WORLD_SIZE", w}, {"GROUP_RANK", "0"},
               {"GROUP_WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)},
               {"DTRAIN_STDOUT_ISATTY", "0"}}) {
        ::setenv(k, v.c_str(), 1);
      }
      for (const auto& [k, v] : allocator) ::setenv(k.c_str(), v.c_str(), 1);
      ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");  // (rank 0 serves the store, as under torch's env://)
      ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(p[1]);
    ranks[static_cast<size_t>(r)].pid = pid;
    ranks[static_cast<size_t>(r)].fd = p[0];
  }
  CommandResult result;
  result.exit_code = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  auto stop_all = [&](int sig) {
    for (auto& k : ranks) {
      if (k.running) ::kill(k.pid, sig);
    }
  };
  bool stopping = false;
  int open = world;
  while (open > 0) {
    std::vector<pollfd> fds;
    std::vector<size_t> of;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (ranks[i].fd >= 0) {
        fds.push_back({ranks[i].fd, POLLIN, 0});
        of.push_back(i);
      }
    }
    ::poll(fds.data(), fds.size(), 200);
    for (size_t j = 0; j < fds.size(); ++j) {
      if (!(fds[j].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Rank& k = ranks[of[j]];
      char buf[4096];
      const ssize_t n = ::read(k.fd, buf, sizeof buf);
      if (n <= 0) {
        if (!k.partial.empty()) result.output += "[" + std::to_string(of[j]) + "]:" + k.partial + "\n";
        ::close(k.fd);
        k.fd = -1;
        --open;
        continue;
      }
      k.partial.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = k.partial.find('\n')) != std::string::npos;) {
        result.output += "[" + std::to_string(of[j]) + "]:" + k.partial.substr(0, nl + 1);
        k.partial.erase(0, nl + 1);
      }
    }
    // A rank that failed stops the others (as dtrun does: no rank waits forever in a collective).
    for (size_t i = 0; i < ranks.size(); ++i) {
      int status = 0;
      if (!ranks[i].running || ::waitpid(ranks[i].pid, &status, WNOHANG) != ranks[i].pid) continue;
      ranks[i].running = false;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && !stopping) {
        result.output += "launch_ranks: rank " + std::to_string(i) + " exited with code " + std::to_string(code) +
                         "; stopping the other ranks\n";
        result.exit_code = 1;
        stopping = true;
        stop_all(SIGTERM);
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      result.output += "launch_ranks: timed out after " + std::to_string(timeout_s) + " s\n";
      result.exit_code = 124;
      stop_all(SIGKILL);
      break;
    }
  }
  for (auto& k : ranks) {
    if (k.fd >= 0) ::close(k.fd);
    if (!k.running) continue;
    int status = 0;
    ::waitpid(k.pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0 && result.exit_code == 0) result.exit_code = 1;
  }
  return result;
}

}  // namespace dtrain::testing
