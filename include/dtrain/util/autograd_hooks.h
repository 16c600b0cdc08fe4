#pragma once
// Design note [backward hooks]
// ----------------------------
// libtorch modules have no forward or backward hooks (torch.nn.Module's register_*_hook are
// Python-only). So in dtrain:
//  1. A wrapper (DistributedDataParallel, later FSDP) owns the forward call: it runs its
//     pre-forward work, calls the wrapped module's forward, and runs its post-forward work on the
//     outputs (e.g. finding parameters the autograd graph does not reach).
//  2. Per-parameter backward work hangs off the parameter's gradient accumulator (the AccumulateGrad
//     node autograd creates for a leaf) as a post hook: it runs right after the parameter's .grad
//     has received this backward's contribution, which is exactly "this gradient is ready".
//     The accumulator is held alive by the hook owner (autograd keeps only a weak reference, and a
//     new accumulator without our hook would otherwise be made for the next backward).
//  3. Work that must run once backward is over (waiting for in-flight reductions, writing the
//     results back) is queued on the autograd engine with Engine::queue_callback from the first
//     hook of that backward; the engine runs it on the thread that called backward, before
//     backward() returns, and an exception there surfaces from backward().
// This is how PyTorch's own C++ Reducer (torch/csrc/distributed/c10d/reducer.cpp) works.
// GradReadyHooks packages (2) and (3) so DDP, ZeRO-2 and FSDP share one implementation.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/compat.h"

namespace dtrain::util {

class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;
  ~GradReadyHooks();  // removes every hook it installed

  // Calls fn(index) each time `param`'s gradient has been accumulated in a backward pass.
  // `param` must be a leaf that requires grad.
  void add(const at::Tensor& param, size_t index, std::function<void(size_t)> fn);

  // The autograd node that accumulates `index`'s gradient (for graph traversal).
  const torch::autograd::Node* accumulator(size_t index) const;
  size_t size() const { return hooks_.size(); }

 private:
  struct Entry {
    compat::NodePtr accumulator;
    std::uintptr_t key = 0;
    size_t index = 0;
  };
  std::vector<Entry> hooks_;
};

// The per-iteration phase of a hook-driven reducer (DDP's, ZeRO-2's): armed by a synced forward,
// reducing from the first gradient hook of its backward until the end-of-backward callback.
class BackwardRound {
 public:
  enum class Phase {
    Idle,      // no reduction expected: no synced forward since the last one (or under no_sync)
    Armed,     // a synced forward ran; waiting for the first gradient of its backward
    Reducing,  // inside that backward: buckets fill and launch; ends with the queued callback
  };
  // After a synced forward. Throws (naming `who`) if the previous backward is still reducing.
  void arm(const std::string& who);
  // From a gradient hook: false when no reduction is expected (the hook should do nothing). On
  // the first hook of an armed backward, queues `at_end` to run when that backward finishes.
  bool on_hook(std::function<void()> at_end);
  // At the start of the end-of-backward callback: back to Idle.
  void end() { phase_ = Phase::Idle; }
  Phase phase() const { return phase_; }

 private:
  Phase phase_ = Phase::Idle;
};

// Queues fn to run when the current backward pass finishes (see the design note). Must be
// called from inside a backward pass (e.g. from a GradReadyHooks callback).
void queue_end_of_backward(std::function<void()> fn);

// The set of autograd nodes reachable from `outputs` (their grad_fn and everything behind it).
std::vector<const torch::autograd::Node*> reachable_nodes(const std::vector<at::Tensor>& outputs);

}  // namespace dtrain::util
