// dtrun_test_worker: a worker for dtrun's tests that meets the other ranks in the agent store.
//
//   dtrun_test_worker store   connects to MASTER_ADDR:MASTER_PORT as a TCPStore client (as the
//                             library does under TORCHELASTIC_USE_AGENT_STORE=True), under the
//                             prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>, sets
//                             rank/<RANK>, waits for every rank's key and prints what it saw.
//   dtrun_test_worker allreduce
//                             the library's way: dtrain::comm::init_process_group() (env://,
//                             Gloo) and an all_reduce of ones; prints the sum (= world size).
//   dtrun_test_worker stop    three all_reduces, then the last rank stops itself (SIGSTOP) and the
//                             others enter a fourth: a stall for dtrun --stall-timeout to name.
//   dtrun_test_worker desync  three all_reduces, then rank 1 waits in a recv from rank 0 while the
//                             others enter a fourth all_reduce: ranks that disagree.
//   dtrun_test_worker intrude HOST PORT
//                             an outsider (no job secret): connects to a job's agent store and
//                             writes what would have stopped a job with exit code 0 and a message
//                             of its choosing (dtrun/abort, round 0's failure); prints what it did.
//   dtrun_test_worker halfsend HOST PORT S [wait]
//                             connects to a store (with "wait": retrying every 10 ms for up to 20 s,
//                             to be there before a job's workers) and sends the first byte of a
//                             request, then holds the connection up to S seconds (what froze 1.13's
//                             store server and dtrun); prints when the store closed it.
//   dtrun_test_worker hugekey HOST PORT
//                             sends a request that announces a 4e9-byte key (what grew dtrun by
//                             3 GB) and prints when the store closed the connection.
//   dtrun_test_worker timeout a 3-s collective timeout; the last rank sleeps 20 s outside any
//                             collective while the others all_reduce: their error names it.
#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <csignal>
#include <cstdlib>
#include <thread>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/comm.h"

namespace {
std::string env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) {
    std::cerr << "dtrun_test_worker: " << name << " is not set\n";
    std::exit(2);
  }
  return v;
}
}  // namespace

int all_reduce_mode() {
  using namespace dtrain::comm;
  auto pg = init_process_group(
      InitOptions().backend("gloo").timeout(std::chrono::seconds(20)).configure_threads(false));
  auto t = at::ones({4});
  all_reduce(pg, t).wait();
  std::cout << "rank " << pg.rank() << " of " << pg.size() << ": all_reduce sum = " << t[0].item<float>()
            << std::endl;
  return 0;
}

// The stall and timeout scenarios (see the top).
int hang_mode(const std::string& mode) {
  using namespace dtrain::comm;
  const auto timeout = mode == "timeout" ? std::chrono::seconds(3) : std::chrono::seconds(120);
  auto pg = init_process_group(InitOptions().backend("gloo").timeout(timeout).configure_threads(false));
  auto t = at::ones({4});
  for (int i = 0; i < 3; ++i) all_reduce(pg, t).wait();
  const int last = pg.size() - 1;
  std::cout << "rank " << pg.rank() << ": three all_reduces done" << std::endl;
  try {
    if (mode == "stop" && pg.rank() == last) std::raise(SIGSTOP);
    if (mode == "timeout" && pg.rank() == last) {
      std::this_thread::sleep_for(std::chrono::seconds(20));
      return 0;
    }
    if (mode == "desync" && pg.rank() == 1) {
      auto r = at::zeros({2});
      recv(pg, r, 0).wait();
    } else {
      all_reduce(pg, t).wait();
    }
  } catch (const std::exception& e) {
    std::cerr << "rank " << pg.rank() << ": " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

int intrude_mode(const std::string& host, int port) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(port);
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(5);
  auto store = dtrain::compat::make_tcp_store(host, o);
  const std::string forged = "0\n0\n0\nforged by an intruder";
  for (const char* key : {"dtrun/abort", "dtrun/round/0/failure"}) {
    store->set(key, std::vector<uint8_t>(forged.begin(), forged.end()));
  }
  std::cout << "intruder: wrote dtrun/abort and round 0's failure" << std::endl;
  return 0;
}

namespace {
// A connection to host:port (retrying every 10 ms for up to 20 s with `wait`); -1 on failure.
int connect_to(const std::string& host, const std::string& port, bool wait) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    addrinfo* res = nullptr;
    if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res) return -1;
    const int fd = ::socket(res->ai_family, SOCK_STREAM, 0);
    const bool ok = fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0;
    ::freeaddrinfo(res);
    if (ok) return fd;
    if (fd >= 0) ::close(fd);
    if (!wait || std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Waits up to `seconds` for the peer to close `fd`; prints what happened.
void report_close(const char* who, int fd, int seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  timeval tv{};
  tv.tv_sec = 0;
  tv.tv_usec = 200 * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  for (;;) {
    char c;
    const ssize_t n = ::recv(fd, &c, 1, 0);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      std::cout << who << ": the store closed the connection after " << s << " s" << std::endl;
      return;
    }
    if (s >= seconds) {
      std::cout << who << ": still open after " << seconds << " s" << std::endl;
      return;
    }
  }
}
}  // namespace

int half_send_mode(const std::string& host, const std::string& port, int seconds, bool wait) {
  const int fd = connect_to(host, port, wait);
  if (fd < 0) return 3;
  const char first = 0;  // a request's type byte, and nothing after it
  if (::send(fd, &first, 1, 0) != 1) return 4;
  std::cout << "halfsend: holding a half-sent request" << std::endl;
  report_close("halfsend", fd, seconds);
  ::close(fd);
  return 0;
}

int huge_key_mode(const std::string& host, const std::string& port) {
  const int fd = connect_to(host, port, false);
  if (fd < 0) return 3;
  unsigned char request[9] = {0};  // SET, then the key's length (uint64, host order), then nothing
  const std::uint64_t length = 4000000000ULL;
  std::memcpy(request + 1, &length, sizeof length);
  if (::send(fd, request, sizeof request, 0) != static_cast<ssize_t>(sizeof request)) return 4;
  std::cout << "hugekey: announced a 4e9-byte key" << std::endl;
  report_close("hugekey", fd, 20);
  ::close(fd);
  return 0;
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "store";
  if (mode == "halfsend" && (argc == 5 || argc == 6))
    return half_send_mode(argv[2], argv[3], std::stoi(argv[4]), argc == 6 && std::string(argv[5]) == "wait");
  if (mode == "hugekey" && argc == 4) return huge_key_mode(argv[2], argv[3]);
  if (mode == "intrude" && argc == 4) return intrude_mode(argv[2], std::stoi(argv[3]));
  if (mode == "allreduce") return all_reduce_mode();
  if (mode == "stop" || mode == "desync" || mode == "timeout") return hang_mode(mode);
  if (mode != "store") {
    std::cerr << "dtrun_test_worker: unknown mode " << mode << "\n";
    return 2;
  }
  const int rank = std::stoi(env("RANK"));
  const int world = std::stoi(env("WORLD_SIZE"));
  const std::string restart = env("TORCHELASTIC_RESTART_COUNT");
  if (env("TORCHELASTIC_USE_AGENT_STORE") != "True") {
    std::cerr << "dtrun_test_worker: expected TORCHELASTIC_USE_AGENT_STORE=True\n";
    return 2;
  }
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(std::stoi(env("MASTER_PORT")));
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = std::chrono::seconds(15);
  auto tcp = dtrain::compat::make_tcp_store(env("MASTER_ADDR"), o);
  c10d::PrefixStore store("/worker/attempt_" + restart, tcp);
  const std::string hello = "hello from " + std::to_string(rank);
  store.set("rank/" + std::to_string(rank), std::vector<uint8_t>(hello.begin(), hello.end()));
  std::string seen;
  for (int r = 0; r < world; ++r) {
    auto v = store.get("rank/" + std::to_string(r));  // waits for the key (store timeout)
    if (std::string(v.begin(), v.end()) != "hello from " + std::to_string(r)) {
      std::cerr << "dtrun_test_worker: bad value for rank " << r << "\n";
      return 3;
    }
    seen += (r ? "," : "") + std::to_string(r);
  }
  std::cout << "rank " << rank << " of " << world << " sees ranks " << seen << " in the agent store" << std::endl;
  // Keep the store connection until everyone has read every key.
  store.add("done", 1);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (store.add("done", 0) < world && std::chrono::steady_clock::now() < deadline) {
    struct timespec ts{0, 10 * 1000 * 1000};
    nanosleep(&ts, nullptr);
  }
  return 0;
}
