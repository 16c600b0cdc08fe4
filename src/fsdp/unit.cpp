#include "dtrain/fsdp/unit.h"

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
