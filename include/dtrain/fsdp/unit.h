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

#include "dtrain/fsdp/flat_param.h"
#include "dtrain/util/autograd_hooks.h"

namespace dtrain::fsdp {

struct Unit {
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
  size_t ready_grads = 0;
  // The state; changed only through to(), which checks the transition (as FSDP2's
  // _assert_in_states): Idle <- any (iteration reset); Forward <- Idle, Forwarded (a module called
  // twice in one forward); Forwarded <- Forward; BackwardPre <- Idle, Forward, Forwarded (a gradient
  // reached the unit); Reduced <- BackwardPre, Forwarded, Forward (end of backward: unused parameters).
  State state = State::Idle;
  void to(State next);
  util::GradReadyHooks grad_hooks;  // on its trainable module parameters

  bool gathered() const;            // every FlatParam Gathered (or nothing to gather)
  bool gathering() const;           // some FlatParam Gathering
  int64_t full_bytes() const;       // bytes of its gathered parameters
};

const char* to_string(Unit::State s);

}  // namespace dtrain::fsdp
