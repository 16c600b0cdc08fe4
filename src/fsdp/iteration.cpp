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

void FullyShardedState::count_gathers(int started) {
  if (groups_.layout.shard > 1) stats_.all_gathers += started;
}

void FullyShardedState::gather(Unit& u, bool wait) {
  count_gathers(u.gather_async());
  if (!wait) return;
  u.wait_gather();
  note_memory();
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
  for (auto& u : units_) u->reset();
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
    for (auto& u : units_) u->reset();
  } else {
    forward_order_.clear();  // (units are Idle: end_of_backward or finish_leftover_iteration reset them)
    synced_iteration_ = sync_;
  }
  phase_ = Phase::Forward;
  count_gathers(units_[0]->pre_forward());
  note_memory();
  if (options_.forward_prefetch()) prefetch(last_forward_order_, -1);
}

void FullyShardedState::after_forward(const std::vector<at::Tensor>& outs) {
  std::lock_guard<std::mutex> lock(mu_);
  // (The root's reshard_after_forward is false: it stays gathered until the end of backward.)
  if (!units_[0]->post_forward(outs)) {
    finish_leftover_iteration();
    return;
  }
  // The first output whose gradient arrives starts the root's backward (pre_backward runs once).
  for (const auto& o : outs) {
    if (o.defined() && o.requires_grad()) const_cast<at::Tensor&>(o).register_hook([this](const at::Tensor&) { pre_backward(*units_[0]); });
  }
}

at::Tensor FullyShardedState::finish_output(at::Tensor out) {
  if (auto dt = options_.mixed_precision().output_dtype()) {
    if (out.defined() && at::isFloatingType(out.scalar_type()) && out.scalar_type() != *dt) out = out.to(*dt);
  }
  return out;
}

void FullyShardedState::pre_forward(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Backward) {
    // A recomputation in backward (checkpointing outside FSDP): gather, keep until post-backward.
    gather(u, /*wait=*/true);  // no transition: the unit is in its backward
    return;
  }
  TORCH_CHECK(phase_ == Phase::Forward, describe(), ": unit ", u.name, " ran outside the wrapped model's forward; "
              "call the FullyShardedDataParallel wrapper's forward, not the inner module's");
  forward_order_.push_back(u.index);
  count_gathers(u.pre_forward());
  note_memory();
  if (options_.forward_prefetch() && last_forward_order_.size() >= forward_order_.size()) {
    prefetch(last_forward_order_, static_cast<int>(forward_order_.size()) - 1);
  }
}

void FullyShardedState::post_forward(Unit& u, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Backward) return;  // a recomputation: parameters stay for this backward
  if (!u.post_forward(outputs)) return;
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
  if (u.in_backward()) return;
  count_gathers(u.pre_backward());
  note_memory();
  // The root stays gathered through the whole backward: AfterBackward's only chance to prefetch
  // the first nested unit is here (Design note [backward memory]).
  const auto bp = options_.backward_prefetch();
  if (bp == BackwardPrefetch::BeforeBackward || (bp == BackwardPrefetch::AfterBackward && u.index == 0)) {
    prefetch_backward(u);  // before finishing reductions: the gather overlaps them
  }
  if (!options_.overlap_reduction()) finish_reductions(&u);
  u.bind_grad_slots();
  note_memory();
}

void FullyShardedState::on_grad_ready(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Idle) return;  // a backward FSDP did not prepare (no forward through the wrapper)
  start_backward_round();
  if (!u.grad_ready()) return;
  post_backward(u);
  // After u's parameters were freed and its reduction launched (Design note [backward memory]);
  // the root's post-backward ends the backward (it prefetched at its pre-backward).
  if (options_.backward_prefetch() == BackwardPrefetch::AfterBackward && u.index != 0) prefetch_backward(u);
}

void FullyShardedState::post_backward(Unit& u) {
  if (u.state() == Unit::State::Reduced) return;
  // Serial reductions: the previous one ends before this one starts, also where no other unit's
  // pre-backward came in between (the root's, at the very end).
  if (!options_.overlap_reduction()) finish_reductions(&u);
  const int launched = u.post_backward(/*reduce=*/synced_iteration_);
  if (groups_.world.size() > 1) stats_.reduce_scatters += launched;
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
    if (u->backward_unfinished()) post_backward(*u);
  }
  finish_reductions(nullptr);
  note_memory();
  for (auto& u : units_) u->reset();
  last_forward_order_ = forward_order_;
  forward_order_.clear();
  phase_ = Phase::Idle;
}

}  // namespace dtrain::fsdp
