// dtrun: the launcher (torchrun's contract, in C++). See docs/launch.md and `dtrun --help`.
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <vector>

#include "dtrain/launch/agent.h"
#include "dtrain/launch/bind_restriction.h"

// Design note [control plane] (launch/bind_restriction.h): this definition takes precedence over
// libc's bind() for every library in the process (the link exports it), so that the agent store's
// wildcard bind can be kept to one address.
extern "C" int bind(int fd, const struct sockaddr* addr, socklen_t len) {
  sockaddr_storage sub{};
  socklen_t sub_len = 0;
  bool refuse = false;
  if (dtrain::launch::restricted_bind_address(addr, &sub, &sub_len, &refuse)) {
    return static_cast<int>(::syscall(SYS_bind, fd, reinterpret_cast<const sockaddr*>(&sub), sub_len));
  }
  if (refuse) {
    errno = EADDRNOTAVAIL;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_bind, fd, addr, len));
}

// Design note [store server process] (launch/store_server.h): in the agent store's process, every
// accepted connection gets socket timeouts, so that a half-sent request cannot hold the server.
extern "C" int accept4(int fd, struct sockaddr* addr, socklen_t* len, int flags) {
  const int c = static_cast<int>(::syscall(SYS_accept4, fd, addr, len, flags));
  if (c >= 0) dtrain::launch::on_accepted_socket(c);
  return c;
}
extern "C" int accept(int fd, struct sockaddr* addr, socklen_t* len) { return accept4(fd, addr, len, 0); }

int main(int argc, char** argv) {
  return dtrain::launch::dtrun_main(std::vector<std::string>(argv + 1, argv + argc));
}
