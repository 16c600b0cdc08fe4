#pragma once
// Which modules of a model become FSDP units and which unit owns each parameter, as a pure function
// of the module tree and the wrap policy (nothing hooked, nothing moved). FullyShardedState builds
// its units from it (and then makes the picked stock layers hookable); the memory planner
// (train/planner.h) counts the units' sizes from the same plan. (FSDP also refuses a picked module
// that cannot get forward hooks when the policy does not skip those: the plan lists it as a unit.)
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/nn/module.h>

#include "dtrain/fsdp/wrap.h"

namespace dtrain::fsdp {

struct UnitPlan {
  struct Node {
    std::string name;            // path in the model ("" for the root)
    torch::nn::Module* module;   // as walked (FSDP may put a hookable module in its place after)
    int parent;                  // index in `nodes`, -1 for the root
  };
  std::vector<Node> nodes;       // pre-order: a parent before its children
  std::vector<int> unit_nodes;   // per unit (pre-order; unit 0 is the root), its node
  std::vector<int> unit_parents; // per unit, the unit enclosing it (-1 for the root)
  // Each distinct parameter (by TensorImpl) -> the innermost unit enclosing every module that holds
  // it (a tied parameter used in two units goes to the unit enclosing both).
  std::unordered_map<const void*, int> owner;
};

// Bottom-up, the policy is asked for every module but the root with the parameters of its subtree
// that no nested unit took; a picked module takes them, the root takes the rest. A module that cannot
// get forward hooks where it is (nn::can_hook_in) is passed over when policy.skip_unhookable is set.
UnitPlan plan_units(torch::nn::Module& model, const WrapPolicy& policy);

}  // namespace dtrain::fsdp
