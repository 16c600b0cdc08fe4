#include "dtrain/launch/bind_restriction.h"

#include <netdb.h>
#include <netinet/in.h>

#include <sys/time.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "dtrain/launch/options.h"

namespace dtrain::launch {

namespace {
// The active restriction (one at a time: dtrun creates its store once, on one thread).
struct Active {
  std::mutex mu;
  bool on = false;
  bool applied = false;
  bool have4 = false, have6 = false;
  sockaddr_in v4{};
  sockaddr_in6 v6{};
};
Active& active() {
  static Active a;
  return a;
}
}  // namespace

BindRestriction::BindRestriction(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) throw LaunchError("cannot resolve --master-addr " + host + " (" + gai_strerror(rc) + ")");
  Active& a = active();
  std::lock_guard<std::mutex> lock(a.mu);
  a.applied = a.have4 = a.have6 = false;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    if (ai->ai_family == AF_INET && !a.have4) {
      std::memcpy(&a.v4, ai->ai_addr, sizeof(a.v4));
      a.have4 = true;
    } else if (ai->ai_family == AF_INET6 && !a.have6) {
      std::memcpy(&a.v6, ai->ai_addr, sizeof(a.v6));
      a.have6 = true;
    }
  }
  ::freeaddrinfo(res);
  a.on = true;
}

BindRestriction::~BindRestriction() {
  Active& a = active();
  std::lock_guard<std::mutex> lock(a.mu);
  a.on = false;
}

bool BindRestriction::applied() const {
  Active& a = active();
  std::lock_guard<std::mutex> lock(a.mu);
  return a.applied;
}

bool restricted_bind_address(const sockaddr* addr, sockaddr_storage* out, socklen_t* len, bool* refuse) {
  *refuse = false;
  if (!addr) return false;
  Active& a = active();
  std::lock_guard<std::mutex> lock(a.mu);
  if (!a.on) return false;
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    if (in->sin_addr.s_addr != htonl(INADDR_ANY)) return false;
    a.applied = true;
    if (!a.have4) {
      *refuse = true;
      return false;
    }
    sockaddr_in sub = a.v4;
    sub.sin_port = in->sin_port;
    std::memcpy(out, &sub, sizeof(sub));
    *len = sizeof(sub);
    return true;
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
    if (!IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) return false;
    a.applied = true;
    sockaddr_in6 sub = a.v6;
    if (!a.have6) {
      if (!a.have4) {
        *refuse = true;
        return false;
      }
      // An IPv4 address only: its IPv4-mapped form (::ffff:a.b.c.d), which a dual-stack socket
      // (as c10d's) accepts, so the server does not log a failed bind before it falls back to IPv4.
      sub = sockaddr_in6{};
      sub.sin6_family = AF_INET6;
      sub.sin6_addr.s6_addr[10] = sub.sin6_addr.s6_addr[11] = 0xff;
      std::memcpy(&sub.sin6_addr.s6_addr[12], &a.v4.sin_addr, 4);
    }
    sub.sin6_port = in6->sin6_port;
    std::memcpy(out, &sub, sizeof(sub));
    *len = sizeof(sub);
    return true;
  }
  return false;
}

namespace {
std::atomic<long> g_accept_timeout_ms{0};
std::atomic<long> g_accepted_limited{0};
}  // namespace

void limit_accepted_sockets(std::chrono::milliseconds timeout) { g_accept_timeout_ms = timeout.count(); }

void on_accepted_socket(int fd) {
  const long ms = g_accept_timeout_ms.load();
  if (fd < 0 || ms <= 0) return;
  timeval tv{};
  tv.tv_sec = ms / 1000;
  tv.tv_usec = (ms % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  ++g_accepted_limited;
}

long accepted_sockets_limited() { return g_accepted_limited.load(); }

}  // namespace dtrain::launch
