#pragma once
// Unit: the per-module state of FSDP. A unit is the root module or a module a WrapPolicy picked; it
// owns the FlatParams of the parameters in its subtree that no nested unit owns (tied parameters go
// to the innermost unit enclosing all their uses), and walks one state machine per iteration.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include <ATen/core/Tensor.h>

#include "dtrain/fsdp/flat_param.h"
#include "dtrain/util/autograd_hooks.h"

namespace dtrain::fsdp {

// The unit does its own part of each step of an iteration (gather, free, bind gradient slots,
// launch reductions) and checks its own transitions; FullyShardedState (iteration.cpp) decides
// when each runs (the phase of the iteration, prefetching, at most one reduction in flight) and
// counts what they cost.
class Unit {
 public:
  enum class State {
    Idle,         // no work of this iteration yet (parameters sharded, except an aliased NoShard buffer)
    Forward,      // inside the unit's forward: parameters gathered
    Forwarded,    // its forward returned: parameters freed (FullShard) or kept for backward
    BackwardPre,  // a gradient reached its outputs (or its first parameter): parameters gathered for backward
    Reduced,      // every gradient it expects arrived: reduction launched, parameters freed
  };

  std::string name;                 // path in the model ("" for the root)
  torch::nn::Module* module = nullptr;
  int index = 0;                    // in FullyShardedState::units() (0 is the root)
  int parent = -1;                  // index of the enclosing unit (-1 for the root)
  std::vector<std::unique_ptr<FlatParam>> flats;  // one per (dtype, trainable) group
  bool reshard_after_forward = true;
  uint64_t forward_hook = 0;        // id in the module's ForwardHooks (nested units)
  size_t expected_grads = 0;        // trainable parameters (a gradient each per synced backward)
  util::GradReadyHooks grad_hooks;  // on its trainable module parameters

  State state() const { return state_; }

  // --- parameters ---
  int gather_async();   // starts the all-gather of every sharded FlatParam; returns how many it started
  void wait_gather();   // every FlatParam Gathered
  // every FlatParam Sharded (an aliased NoShard buffer stays); `for_backward`: NodeSharded where a
  // secondary shard applies (Design note [secondary shards]).
  void reshard(bool for_backward = false);
  bool gathered() const;            // every FlatParam Gathered (or nothing to gather)
  bool gathering() const;           // some FlatParam Gathering
  int64_t full_bytes() const;       // bytes of its gathered parameters

  // --- one iteration; each call checks the transition it makes ---
  // Idle|Forwarded -> Forward: parameters gathered (waits for a prefetch in flight). Returns the
  // all-gathers it started (none when a prefetch did).
  int pre_forward();
  // Forward -> Forwarded; frees the parameters unless kept for backward (reshard_after_forward
  // false, in grad mode). Returns whether a backward will follow (an output requires grad).
  bool post_forward(const std::vector<at::Tensor>& outputs);
  // Whether this backward already reached the unit (BackwardPre or Reduced).
  bool in_backward() const { return state_ == State::BackwardPre || state_ == State::Reduced; }
  // -> BackwardPre (not in_backward()): parameters gathered. Returns the all-gathers it started.
  int pre_backward();
  // Before its gradients arrive: each trainable FlatParam's gradient slots (FlatParam::bind_grad_slots).
  void bind_grad_slots();
  // One of its trainable parameters got its gradient; true when it was the last one expected
  // (the unit enters BackwardPre on the first if no pre_backward ran, e.g. its outputs were unused).
  bool grad_ready();
  // -> Reduced: launches the reduction of every trainable FlatParam's gradient when `reduce`
  // (false under no_sync), frees the parameters. Returns the reductions launched (0 if already Reduced).
  int post_backward(bool reduce);
  // Whether this iteration reached the unit but its backward did not finish (unused parameters).
  bool backward_unfinished() const { return state_ != State::Idle && state_ != State::Reduced && expected_grads > 0; }
  // -> Idle: sharded, no gradient counted (end of an iteration, or a forward without backward).
  void reset();

 private:
  // The state changes only here, checked (as FSDP2's _assert_in_states): Idle <- any (iteration
  // reset); Forward <- Idle, Forwarded (a module called twice in one forward); Forwarded <- Forward;
  // BackwardPre <- Idle, Forward, Forwarded (a gradient reached the unit); Reduced <- BackwardPre,
  // Forwarded, Forward (end of backward: unused parameters).
  void to(State next);
  State state_ = State::Idle;
  size_t ready_grads_ = 0;
};

const char* to_string(Unit::State s);

}  // namespace dtrain::fsdp
