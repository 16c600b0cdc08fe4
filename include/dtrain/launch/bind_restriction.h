#pragma once
// Keeps dtrun's agent store off interfaces it should not listen on.
//
// Design note [control plane]
// ---------------------------
// The agent store (c10d's TCPStore, hosted by node 0's dtrun) steers the job: failure records,
// the abort key and its exit code, the workers' rendezvous. Two things keep other processes out:
//  - Where it listens. c10d's TCPStore server binds the wildcard address (every interface) and has
//    no option to choose one in 1.13. dtrun's executable defines bind() (tools/dtrun.cpp), which
//    takes precedence over libc's for libtorch's calls; while a BindRestriction is alive it
//    rewrites a wildcard bind to the one address given: 127.0.0.1 for --standalone, the
//    --master-addr otherwise (a wildcard bind of the other address family fails, so the server
//    takes the given one). Programs that merely link dtrain are not affected.
//  - What it names. Every key of a job is named after the job's secret ("job-<secret>/dtrun/...",
//    "job-<secret>/worker/attempt_N/..."): made by dtrun for --standalone, else given to every node
//    (--job-secret-file, DTRAIN_JOB_SECRET) and passed to the workers as DTRAIN_JOB_SECRET. A
//    client without it cannot name, so cannot read or write, anything the job keeps there: not stop
//    it, nor choose its exit code (the store has no operation that lists keys in 1.13).
//  - Who waits on it. One node's dtrun never calls the store while it supervises (signals, workers'
//    exits, restarts, stalls: Agent::coordinates()), and never destroys the server (whose daemon a
//    client holding a half-sent request blocks): such a client cannot delay it.
//  - What it costs. The server runs in a process of its own with bounded memory and socket
//    timeouts (Design note [store server process]); several nodes' agents call it from a thread
//    of their own (Design note [agents never wait on the store]). A client that reaches the port
//    can still slow the server (a half-sent request holds it for up to kStoreSocketTimeout), which
//    slows the workers' rendezvous but cannot steer the job; loopback-only standalone stores limit
//    that to local users.
#include <sys/socket.h>

#include <chrono>
#include <string>

namespace dtrain::launch {

class BindRestriction {
 public:
  // Wildcard binds go to `host`'s address (resolved now; throws LaunchError if it does not resolve).
  explicit BindRestriction(const std::string& host);
  ~BindRestriction();
  BindRestriction(const BindRestriction&) = delete;
  BindRestriction& operator=(const BindRestriction&) = delete;
  // Whether a wildcard bind was rewritten while this restriction was alive.
  bool applied() const;
};

// For the bind() interposer: while a restriction is alive, the address (with `*addr`'s port) a
// wildcard bind of `addr->sa_family` must use; returns false to bind as asked. `*refuse` is set
// when this family has no address (the bind must fail).
bool restricted_bind_address(const sockaddr* addr, sockaddr_storage* out, socklen_t* len, bool* refuse);

// For the accept() interposer (Design note [store server process]): from the call on, every
// socket this process accepts gets receive and send timeouts of `timeout` (the store server's
// process calls it; nothing else does).
void limit_accepted_sockets(std::chrono::milliseconds timeout);
void on_accepted_socket(int fd);
// Sockets given timeouts so far (tests: shows that dtrun's accept() is the one the server calls).
long accepted_sockets_limited();

}  // namespace dtrain::launch
