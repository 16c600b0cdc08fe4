#include "dtrain/fsdp/fully_sharded_data_parallel.h"

// FullyShardedState, one iteration: the forward and backward hooks, gathering, prefetching and
// reductions (construction: fully_sharded_data_parallel.cpp; shards and state dicts: state_access.cpp).

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "../internal/wrapper_common.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/nn/forward_hooks.h"
#include "dtrain/nn/hooked.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/util/system.h"

namespace dtrain::fsdp {

// ---------------------------------------------------------------------------------------------
// One iteration. Phase: Idle -> Forward (root forward) -> Backward (first hook of its backward)
// -> Idle (end_of_backward, queued on the autograd engine). Unit states: see unit.h.

void FullyShardedState::gather(Unit& u, bool wait) {
  for (auto& f : u.flats) {
    if (f->state() == FlatParam::State::Sharded) {
      f->gather_async();
      if (groups_.layout.shard > 1) ++stats_.all_gathers;
    }
  }
  if (!wait) return;
  for (auto& f : u.flats) f->wait_gather();
  note_memory();
}

void FullyShardedState::reshard(Unit& u) {
  for (auto& f : u.flats) f->reshard();
}

int FullyShardedState::gathered_nested_units() const {
  int n = 0;
  for (size_t i = 1; i < units_.size(); ++i) {
    const Unit& u = *units_[i];
    if (!u.flats.empty() && u.reshard_after_forward && (u.gathered() || u.gathering())) ++n;
  }
  return n;
}

void FullyShardedState::prefetch(const std::vector<int>& order, int after) {
  // `after` is a position in `order` (-1: before its first unit); the unit after it is prefetched.
  if (after < -1 || after + 1 >= static_cast<int>(order.size())) return;
  Unit& next = *units_[order[after + 1]];
  if (order[after + 1] == 0 || next.flats.empty() || next.gathered() || next.gathering()) return;
  if (gathered_nested_units() >= options_.max_gathered_units()) return;
  gather(next, /*wait=*/false);
  note_memory();  // its full buffer is allocated now
}

void FullyShardedState::prefetch_backward(const Unit& u) {
  // Backward runs the units in reverse forward order: after the root (not in forward_order_) the
  // last unit of forward, after any other unit the one that entered its forward just before it.
  if (u.index == 0) {
    prefetch(forward_order_, static_cast<int>(forward_order_.size()) - 2);
    return;
  }
  for (int i = static_cast<int>(forward_order_.size()) - 1; i > 0; --i) {
    if (forward_order_[i] == u.index) {
      prefetch(forward_order_, i - 2);
      return;
    }
  }
}

void FullyShardedState::finish_reductions(const Unit* except) {
  for (auto* f : all_flats_) {
    bool mine = false;
    if (except) {
      for (auto& g : except->flats) mine |= g.get() == f;
    }
    if (!mine && f->reducing()) f->finish_reduce();
  }
}

void FullyShardedState::finish_leftover_iteration() {
  // A forward whose backward never came (evaluation, or a loss that was not backpropagated).
  for (auto& u : units_) {
    reshard(*u);
    u->to(Unit::State::Idle);
    u->ready_grads = 0;
  }
  if (!forward_order_.empty()) last_forward_order_ = forward_order_;
  forward_order_.clear();
  phase_ = Phase::Idle;
}

void FullyShardedState::before_forward() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(phase_ != Phase::Backward, describe(), ": a forward started while the previous backward was still "
              "running; finish backward() first");
  if (phase_ == Phase::Forward) {
    // A second forward before backward (e.g. two losses summed): units re-gather in backward.
    for (auto& u : units_) {
      reshard(*u);
      u->to(Unit::State::Idle);
    }
  } else {
    for (auto& u : units_) u->ready_grads = 0;
    forward_order_.clear();
    synced_iteration_ = sync_;
  }
  phase_ = Phase::Forward;
  Unit& root = *units_[0];
  gather(root, /*wait=*/true);
  root.to(Unit::State::Forward);
  if (options_.forward_prefetch()) prefetch(last_forward_order_, -1);
}

void FullyShardedState::after_forward(const std::vector<at::Tensor>& outs) {
  std::lock_guard<std::mutex> lock(mu_);
  Unit& root = *units_[0];
  root.to(Unit::State::Forwarded);
  bool backward_follows = false;
  for (const auto& o : outs) backward_follows |= at::GradMode::is_enabled() && o.defined() && o.requires_grad();
  if (!backward_follows) {
    finish_leftover_iteration();
    return;
  }
  // The first output whose gradient arrives starts the root's backward (pre_backward runs once).
  for (const auto& o : outs) {
    if (o.defined() && o.requires_grad()) const_cast<at::Tensor&>(o).register_hook([this](const at::Tensor&) { pre_backward(*units_[0]); });
  }
}

at::Tensor FullyShardedState::after_forward(at::Tensor out) {
  std::lock_guard<std::mutex> lock(mu_);
  Unit& root = *units_[0];
  root.to(Unit::State::Forwarded);
  const bool backward_follows = at::GradMode::is_enabled() && out.defined() && out.requires_grad();
  if (!backward_follows) {
    finish_leftover_iteration();
  } else {
    out.register_hook([this](const at::Tensor&) { pre_backward(*units_[0]); });
  }
  if (auto dt = options_.mixed_precision().output_dtype()) {
    if (out.defined() && at::isFloatingType(out.scalar_type()) && out.scalar_type() != *dt) out = out.to(*dt);
  }
  return out;
}

void FullyShardedState::pre_forward(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Backward) {
    // A recomputation in backward (checkpointing outside FSDP): gather, keep until post-backward.
    gather(u, /*wait=*/true);
    return;
  }
  TORCH_CHECK(phase_ == Phase::Forward, describe(), ": unit ", u.name, " ran outside the wrapped model's forward; "
              "call the FullyShardedDataParallel wrapper's forward, not the inner module's");
  forward_order_.push_back(u.index);
  gather(u, /*wait=*/true);
  u.to(Unit::State::Forward);
  if (options_.forward_prefetch() && last_forward_order_.size() >= forward_order_.size()) {
    prefetch(last_forward_order_, static_cast<int>(forward_order_.size()) - 1);
  }
}

void FullyShardedState::post_forward(Unit& u, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Backward) return;  // a recomputation: parameters stay for this backward
  u.to(Unit::State::Forwarded);
  bool backward_follows = false;
  for (const auto& o : outputs) backward_follows |= o.defined() && o.requires_grad();
  backward_follows &= at::GradMode::is_enabled();
  if (u.reshard_after_forward || !at::GradMode::is_enabled()) reshard(u);
  if (!backward_follows) return;
  Unit* up = &u;
  for (const auto& o : outputs) {
    if (o.defined() && o.requires_grad()) {
      const_cast<at::Tensor&>(o).register_hook([this, up](const at::Tensor&) { pre_backward(*up); });
    }
  }
}

void FullyShardedState::start_backward_round() {
  if (phase_ == Phase::Backward) return;
  phase_ = Phase::Backward;
  util::queue_end_of_backward([this] { end_of_backward(); });
}

// Design note [backward memory]
// ------------------------------
// In backward, unit k needs its full parameters (4 B x P_k in fp32) and a flat gradient buffer of
// the same size; beyond that and the shards, what a rank holds depends on how much communication
// is to overlap computation (the root, gathered from its forward to the end of backward because
// its embeddings get their gradients last, adds its own parameters and gradients throughout):
//
//   backward_prefetch  overlap_reduction  held in unit k's backward           overlapped with compute
//   BeforeBackward     true (default)     params k, k-1; grads k, k+1: 16 B   gather k-1, reduce k+1
//   None               true               params k; grads k, k+1:      12 B   reduce k+1
//   AfterBackward      true               params k; grads k, k+1:      12 B   reduce k+1
//   BeforeBackward     false              params k, k-1; grads k:      12 B   gather k-1
//   AfterBackward      false              params k; grads k:            8 B   nothing (lean)
//   None               false              params k; grads k:            8 B   nothing
//
// AfterBackward issues gather k-1 at k's post-backward, right after k's parameters are freed and
// k's reduce-scatter launched, so the two collectives are in flight together (Gloo runs them on
// the process group's two worker threads; NCCL queues them on the group's stream) before k-1's
// computation starts; with
// overlap_reduction false, k-1's pre-backward then finishes reduce k before it allocates k-1's
// gradient buffer, which takes the block reduce k just returned to the BlockPool. That is the
// "memory-lean" backward: the peak is the shards plus one unit's parameters and gradients, the
// root's, and one reduce-scatter output (1/S of a unit), within 1.1x of 16 B x P / W + 8 B x the
// largest unit for the benchmark's GPTs. It costs the overlap: the default keeps it, for speed.
// Figures: bench/README.md (FSDP); the counts above are checked by tests/fsdp/runtime_test.cpp
// (FsdpBackwardMemory).

void FullyShardedState::pre_backward(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  start_backward_round();
  if (u.state == Unit::State::BackwardPre || u.state == Unit::State::Reduced) return;
  gather(u, /*wait=*/true);
  u.to(Unit::State::BackwardPre);
  // The root stays gathered through the whole backward: AfterBackward's only chance to prefetch
  // the first nested unit is here (Design note [backward memory]).
  const auto bp = options_.backward_prefetch();
  if (bp == BackwardPrefetch::BeforeBackward || (bp == BackwardPrefetch::AfterBackward && u.index == 0)) {
    prefetch_backward(u);  // before finishing reductions: the gather overlaps them
  }
  if (!options_.overlap_reduction()) finish_reductions(&u);
  for (auto& f : u.flats) f->bind_grad_slots();
  note_memory();
}

void FullyShardedState::on_grad_ready(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Idle) return;  // a backward FSDP did not prepare (no forward through the wrapper)
  start_backward_round();
  if (u.state != Unit::State::BackwardPre && u.state != Unit::State::Reduced) u.to(Unit::State::BackwardPre);
  if (++u.ready_grads != u.expected_grads) return;
  post_backward(u);
  // After u's parameters were freed and its reduction launched (Design note [backward memory]);
  // the root's post-backward ends the backward (it prefetched at its pre-backward).
  if (options_.backward_prefetch() == BackwardPrefetch::AfterBackward && u.index != 0) prefetch_backward(u);
}

void FullyShardedState::post_backward(Unit& u) {
  if (u.state == Unit::State::Reduced) return;
  // Serial reductions: the previous one ends before this one starts, also where no other unit's
  // pre-backward came in between (the root's, at the very end).
  if (!options_.overlap_reduction()) finish_reductions(&u);
  for (auto& f : u.flats) {
    if (!f->trainable()) continue;
    if (synced_iteration_) {
      f->reduce_grads_async();
      if (groups_.world.size() > 1) ++stats_.reduce_scatters;
    }
    f->reshard();  // frozen FlatParams stay gathered until the end of backward (they have no signal)
  }
  u.to(Unit::State::Reduced);
  note_memory();
  // At most one unit's reduction in flight (as FSDP2): finish the earlier ones, so their
  // gradient buffers do not pile up over the backward.
  finish_reductions(&u);
}

void FullyShardedState::end_of_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  // Units whose gradients did not all arrive (unused parameters): reduce what they have, in unit
  // order (the same on every rank).
  for (auto& u : units_) {
    if (u->state != Unit::State::Idle && u->state != Unit::State::Reduced && u->expected_grads > 0) post_backward(*u);
  }
  finish_reductions(nullptr);
  note_memory();
  for (auto& u : units_) {
    reshard(*u);
    u->to(Unit::State::Idle);
    u->ready_grads = 0;
  }
  last_forward_order_ = forward_order_;
  forward_order_.clear();
  phase_ = Phase::Idle;
}

}  // namespace dtrain::fsdp
