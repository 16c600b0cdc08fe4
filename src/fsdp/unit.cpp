#include "dtrain/fsdp/unit.h"

#include <c10/util/Exception.h>

namespace dtrain::fsdp {

bool Unit::gathered() const {
  for (const auto& f : flats) {
    if (f->state() != FlatParam::State::Gathered) return false;
  }
  return true;
}

bool Unit::gathering() const {
  for (const auto& f : flats) {
    if (f->state() == FlatParam::State::Gathering) return true;
  }
  return false;
}

int64_t Unit::full_bytes() const {
  int64_t n = 0;
  for (const auto& f : flats) n += f->full_bytes();
  return n;
}

void Unit::to(State next) {
  using S = State;
  auto from = [&](std::initializer_list<S> allowed) {
    for (S s : allowed) {
      if (state == s) return true;
    }
    return false;
  };
  bool ok = false;
  switch (next) {
    case S::Idle: ok = true; break;
    case S::Forward: ok = from({S::Idle, S::Forwarded}); break;
    case S::Forwarded: ok = from({S::Forward}); break;
    case S::BackwardPre: ok = from({S::Idle, S::Forward, S::Forwarded}); break;
    case S::Reduced: ok = from({S::BackwardPre, S::Forwarded, S::Forward}); break;
  }
  TORCH_CHECK(ok, "FSDP unit '", name, "': no transition from ", to_string(state), " to ", to_string(next),
              " (a forward or backward outside the order FSDP expects: e.g. the inner module called directly, or "
              "a backward run twice over one forward)");
  state = next;
}

const char* to_string(Unit::State s) {
  switch (s) {
    case Unit::State::Idle: return "Idle";
    case Unit::State::Forward: return "Forward";
    case Unit::State::Forwarded: return "Forwarded";
    case Unit::State::BackwardPre: return "BackwardPre";
    case Unit::State::Reduced: return "Reduced";
  }
  return "?";
}

}  // namespace dtrain::fsdp
