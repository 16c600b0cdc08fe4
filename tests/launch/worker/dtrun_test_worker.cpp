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
//   dtrun_test_worker halfsend HOST PORT S
//                             connects to a store and sends the first byte of a request, then holds
//                             the connection S seconds (what froze 1.13's store server and dtrun).
//   dtrun_test_worker timeout a 3-s collective timeout; the last rank sleeps 20 s outside any
//                             collective while the others all_reduce: their error names it.
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
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

int half_send_mode(const std::string& host, const std::string& port, int seconds) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res) return 2;
  const int fd = ::socket(res->ai_family, SOCK_STREAM, 0);
  if (fd < 0 || ::connect(fd, res->ai_addr, res->ai_addrlen) != 0) return 3;
  ::freeaddrinfo(res);
  const char first = 0;  // a request's type byte, and nothing after it
  if (::send(fd, &first, 1, 0) != 1) return 4;
  std::cout << "halfsend: holding a half-sent request" << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  ::close(fd);
  return 0;
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "store";
  if (mode == "halfsend" && argc == 5) return half_send_mode(argv[2], argv[3], std::stoi(argv[4]));
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
