#include "dtrain/fsdp/unit.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace dtrain::fsdp {

int Unit::gather_async() {
  int started = 0;
  for (auto& f : flats) {
    if (f->state() == FlatParam::State::Sharded || f->state() == FlatParam::State::NodeSharded) {
      f->gather_async();
      ++started;
    }
  }
  return started;
}

void Unit::wait_gather() {
  for (auto& f : flats) f->wait_gather();
}

void Unit::reshard(bool for_backward) {
  for (auto& f : flats) f->reshard(for_backward);
}

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

int Unit::pre_forward() {
  const int started = gather_async();
  wait_gather();
  to(State::Forward);
  return started;
}

bool Unit::post_forward(const std::vector<at::Tensor>& outputs) {
  to(State::Forwarded);
  const bool grad_mode = at::GradMode::is_enabled();
  bool backward_follows = false;
  for (const auto& o : outputs) backward_follows |= o.defined() && o.requires_grad();
  backward_follows = backward_follows && grad_mode;
  if (reshard_after_forward || !grad_mode) reshard(/*for_backward=*/backward_follows);
  return backward_follows;
}

int Unit::pre_backward() {
  TORCH_CHECK(!in_backward(), "FSDP unit '", name, "': its backward started twice in one iteration");
  const int started = gather_async();
  wait_gather();
  to(State::BackwardPre);
  return started;
}

void Unit::bind_grad_slots() {
  for (auto& f : flats) f->bind_grad_slots();
}

bool Unit::grad_ready() {
  if (!in_backward()) to(State::BackwardPre);
  return ++ready_grads_ == expected_grads;
}

int Unit::post_backward(bool reduce) {
  if (state_ == State::Reduced) return 0;
  int launched = 0;
  for (auto& f : flats) {
    if (!f->trainable()) continue;
    if (reduce) {
      f->reduce_grads_async();
      ++launched;
    }
    f->reshard();  // frozen FlatParams stay gathered until the end of backward (they have no signal)
  }
  to(State::Reduced);
  return launched;
}

void Unit::reset() {
  reshard();
  to(State::Idle);
  ready_grads_ = 0;
}

void Unit::to(State next) {
  using S = State;
  auto from = [&](std::initializer_list<S> allowed) {
    for (S s : allowed) {
      if (state_ == s) return true;
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
  TORCH_CHECK(ok, "FSDP unit '", name, "': no transition from ", to_string(state_), " to ", to_string(next),
              " (a forward or backward outside the order FSDP expects: e.g. the inner module called directly, or "
              "a backward run twice over one forward)");
  state_ = next;
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
