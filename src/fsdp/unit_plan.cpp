#include "dtrain/fsdp/unit_plan.h"

#include "dtrain/nn/hooked.h"

namespace dtrain::fsdp {

namespace {

void walk(torch::nn::Module& m, const std::string& name, int parent, std::vector<UnitPlan::Node>& out) {
  const int me = static_cast<int>(out.size());
  out.push_back({name, &m, parent});
  for (const auto& child : m.named_children()) {
    walk(*child.value(), name.empty() ? child.key() : name + "." + child.key(), me, out);
  }
}

}  // namespace

UnitPlan plan_units(torch::nn::Module& model, const WrapPolicy& policy) {
  UnitPlan plan;
  auto& nodes = plan.nodes;
  walk(model, "", -1, nodes);
  // Bottom-up (children come after their parent in `nodes`): count parameters not yet taken and ask
  // the policy; a picked module contributes nothing to its parent.
  std::vector<int64_t> unwrapped(nodes.size(), 0);
  std::vector<char> is_unit(nodes.size(), 0);
  is_unit[0] = 1;
  for (size_t i = nodes.size(); i-- > 0;) {
    for (const auto& p : nodes[i].module->named_parameters(/*recurse=*/false)) unwrapped[i] += p.value().numel();
    if (i > 0 && policy.fn &&
        (!policy.skip_unhookable || nn::can_hook_in(*nodes[nodes[i].parent].module, *nodes[i].module)) &&
        policy.fn(nodes[i].name, *nodes[i].module, unwrapped[i])) {
      is_unit[i] = 1;
    }
    if (i > 0 && !is_unit[i]) unwrapped[nodes[i].parent] += unwrapped[i];
  }
  // Units in pre-order; each node's enclosing unit (its own if it starts one).
  std::vector<int> enclosing(nodes.size(), -1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const int up = nodes[i].parent < 0 ? -1 : enclosing[nodes[i].parent];
    enclosing[i] = up;
    if (is_unit[i]) {
      enclosing[i] = static_cast<int>(plan.unit_nodes.size());
      plan.unit_nodes.push_back(static_cast<int>(i));
      plan.unit_parents.push_back(up);
    }
  }
  // Each distinct parameter goes to the innermost unit enclosing all modules that hold it.
  auto lca = [&](int a, int b) {
    auto depth = [&](int u) {
      int d = 0;
      for (; plan.unit_parents[u] >= 0; u = plan.unit_parents[u]) ++d;
      return d;
    };
    int da = depth(a), db = depth(b);
    for (; da > db; --da) a = plan.unit_parents[a];
    for (; db > da; --db) b = plan.unit_parents[b];
    while (a != b) {
      a = plan.unit_parents[a];
      b = plan.unit_parents[b];
    }
    return a;
  };
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const auto& p : nodes[i].module->named_parameters(/*recurse=*/false)) {
      const void* key = p.value().unsafeGetTensorImpl();
      auto it = plan.owner.find(key);
      plan.owner[key] = it == plan.owner.end() ? enclosing[i] : lca(it->second, enclosing[i]);
    }
  }
  return plan;
}

}  // namespace dtrain::fsdp
