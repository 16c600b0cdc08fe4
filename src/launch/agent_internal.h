#pragma once
// What the agent's files (agent.cpp, agent_rendezvous.cpp) share; not installed.
#include <chrono>
#include <cmath>
#include <optional>
#include <poll.h>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/launch/agent.h"
#include "dtrain/launch/signals.h"
#include "dtrain/launch/store_thread.h"

namespace dtrain::launch {

using Clock = std::chrono::steady_clock;

inline std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000)));
}

inline std::string seconds_text(double s) {
  std::ostringstream o;
  o << s << " s";
  return o.str();
}

inline std::string list(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

template <class T>
std::optional<T> Agent::await(std::future<T> answer) {
  const auto deadline = Clock::now() + ms(options_.heartbeat_timeout_s);
  for (;;) {
    if (ready(answer)) return answer.get();
    if (signals_->stop_count() != stops_seen_) return std::nullopt;
    if (Clock::now() >= deadline)
      throw std::runtime_error("no answer within " + seconds_text(options_.heartbeat_timeout_s) +
                               " (--heartbeat-timeout)");
    pollfd p{signals_->fd(), POLLIN, 0};
    ::poll(&p, 1, 20);
    signals_->drain();
  }
}

}  // namespace dtrain::launch
