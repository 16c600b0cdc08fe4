#pragma once
// The agent store's server, in a process of its own.
//
// Design note [store server process]
// ----------------------------------
// c10d's TCPStore server (1.13's daemon, 2.x's classic one) serves every connection from one
// thread with blocking reads: a client that sends half a request stalls it for everybody, and a
// request that announces a 4 GB key makes it allocate 4 GB before reading a byte of it. Neither
// can be fixed from outside the class, so node 0's dtrun does not host the server in its own
// process. It forks, before it has started any thread, a child (named "dtrun-store") that
//  - limits its own address space (RLIMIT_AS: what it has mapped at the fork plus
//    kStoreMemoryHeadroom): an oversized request fails with std::bad_alloc, which the daemon
//    treats as a broken connection (it closes that one and serves the others);
//  - gives every connection it accepts receive and send timeouts (kStoreSocketTimeout), through
//    dtrun's accept() (tools/dtrun.cpp, as bind() in Design note [control plane]): a half-sent
//    request or a client that does not read its answer costs the others at most that long;
//  - keeps its listening socket to --master-addr (BindRestriction), ignores the signals a
//    terminal sends to dtrun's process group, and dies with dtrun (PR_SET_PDEATHSIG, and a pipe
//    whose other end only dtrun holds).
// dtrun then talks to it as every other client does. WorkerGroup spares it (never counted as left
// behind by the workers) and may reap it if it dies; dtrun leaves it to its own exit (Agent's
// destructor keeps the store: Design note [control plane]), where PR_SET_PDEATHSIG ends it. A
// StoreServer that is destroyed kills and reaps it.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>

namespace dtrain::launch {

// The store process's address-space allowance above what it has mapped when it starts.
inline constexpr size_t kStoreMemoryHeadroom = size_t{1} << 30;  // 1 GiB
// How long one receive or send on a store connection may wait for its peer.
inline constexpr std::chrono::milliseconds kStoreSocketTimeout{5000};

class StoreServer {
 public:
  // Forks the server and waits (up to `timeout`, giving up early when `interrupted()` turns true)
  // until it listens on `host`:`port` (port 0: a free one). Throws LaunchError with the server's
  // own error (port in use, address not of this machine) when it could not start. Call before
  // the process has started threads.
  StoreServer(const std::string& host, int port, std::chrono::milliseconds timeout,
              const std::function<bool()>& interrupted);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }
  pid_t pid() const { return pid_; }

 private:
  void stop();  // ends and reaps the child (if still ours)

  pid_t pid_ = -1;
  int port_ = 0;
  int lifeline_ = -1;  // write end of the pipe whose closing ends the server
};

}  // namespace dtrain::launch
