#pragma once
// Design note [forward hooks]
// ---------------------------
// libtorch modules have no forward hooks, and a parent module calls its children's forward
// directly (GPT calls block->forward(x)), so a wrapper around the ROOT can own its forward (Design
// note [backward hooks], item 1) but nothing outside a model can step in front of a child's
// forward. A module that wants to be a unit of FSDP or of activation checkpointing without the
// model changing says so explicitly: it derives from dtrain::nn::Hookable and runs its forward
// body through forward_hooks().run(inputs, body). With no hooks installed that is one call of
// `body`. Installed hooks are "around" hooks: each receives the inputs and the rest of the chain
// and returns the outputs, so a hook can act before and after (FSDP gathers parameters, then
// frees them) or replace the call (recomputation runs the rest under no_grad and replays it in
// backward). Hooks nest in a fixed order, outermost first (HookOrder), whatever the order they
// were installed in: FSDP outside recomputation, as the FSDP pull request prescribes, so a
// recomputation in backward uses the parameters FSDP gathered for that backward (no extra
// all-gather). Hooks are not copied by clone(): a copy of a module starts without hooks.
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::nn {

using Tensors = std::vector<at::Tensor>;
using ForwardBody = std::function<Tensors(const Tensors&)>;
// Receives the inputs and the rest of the chain (`next`), returns the outputs.
using AroundHook = std::function<Tensors(const Tensors& inputs, const ForwardBody& next)>;

// Nesting order of around hooks, outermost first.
enum class HookOrder : int {
  Sharding = 100,   // FSDP: gather parameters before, free after (fsdp/)
  Recompute = 200,  // activation checkpointing: run without saving activations (recompute/)
  User = 300,       // anything else, innermost
};

class ForwardHooks {
 public:
  ForwardHooks() = default;
  // A copy (e.g. by Cloneable::clone) starts without hooks: hooks capture the original's state.
  ForwardHooks(const ForwardHooks&) {}
  ForwardHooks& operator=(const ForwardHooks&) { return *this; }

  // Returns an id for remove(). Hooks of the same order nest in installation order (first outer).
  uint64_t add(HookOrder order, AroundHook hook);
  void remove(uint64_t id);
  // Removes every hook of `order`; returns how many.
  size_t remove_all(HookOrder order);
  bool has(HookOrder order) const;
  size_t size() const { return hooks_.size(); }

  // body(inputs) wrapped in every hook, outermost first.
  Tensors run(const Tensors& inputs, const ForwardBody& body) const;

 private:
  struct Entry {
    int order;
    uint64_t id;
    AroundHook hook;
  };
  std::vector<Entry> hooks_;  // sorted by (order, id)
  uint64_t next_id_ = 1;
};

// Mixin for modules whose forward runs through ForwardHooks (see the design note):
//   class BlockImpl : public torch::nn::Cloneable<BlockImpl>, public dtrain::nn::Hookable {
//     at::Tensor forward(const at::Tensor& x) {
//       return forward_hooks().run({x}, [this](const nn::Tensors& in) { return nn::Tensors{body(in[0])}; })[0];
//     }
//   };
class Hookable {
 public:
  virtual ~Hookable() = default;
  ForwardHooks& forward_hooks() { return forward_hooks_; }
  const ForwardHooks& forward_hooks() const { return forward_hooks_; }

 private:
  ForwardHooks forward_hooks_;
};

}  // namespace dtrain::nn
