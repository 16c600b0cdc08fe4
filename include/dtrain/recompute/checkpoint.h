#pragma once
// Activation checkpointing (recomputation), as torch.utils.checkpoint and FairScale's
// checkpoint_wrapper: run a piece of the forward without keeping its intermediate activations,
// and recompute them in backward. Not to be confused with training checkpoints (saved state).
//
//   auto y = dtrain::recompute::checkpoint([&](const auto& in) { return std::vector<at::Tensor>{block->forward(in[0])}; },
//                                           {x}, block->parameters())[0];
//   auto wrapped = dtrain::recompute::CheckpointWrapper<GPTBlock>(block);   // module form
//
// Design note [recompute node]: the checkpointed call becomes one autograd node whose inputs are
// the call's tensor inputs AND the parameters it uses. Its backward re-runs the call with grad
// enabled (with the random state of the original forward, of the CPU and of every device the
// call's inputs and parameters are on, so dropout masks match) and computes
// the gradients of the inputs and parameters with torch::autograd::grad, returning them to the
// outer backward. So parameter gradients reach their accumulators in the *outer* backward, where
// DDP's and ZeRO-2's gradient hooks (Design note [backward hooks]) see them as usual; the inner
// pass never touches .grad. Parameters the call uses but that are not passed get no gradient.
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <string>

#include "dtrain/nn/forward_hooks.h"

namespace dtrain::recompute {

using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// Runs fn(inputs) under no_grad and returns its outputs attached to a recompute node (see the
// design note). `params`: the leaves fn uses that need gradients (e.g. module->parameters()).
std::vector<at::Tensor> checkpoint(const Fn& fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params);

// Checkpoints a dtrain::nn::Hookable module in place (Design note [forward hooks]): in training
// mode its forward runs through checkpoint() with the module's parameters. Installed at
// HookOrder::Recompute, so under FSDP the recomputation runs inside the parameters FSDP gathered
// for backward. Returns the hook id (module.forward_hooks().remove(id) undoes it). Throws if the
// module is not Hookable: wrap it in CheckpointWrapper instead.
uint64_t checkpoint_forward(torch::nn::Module& module);

// Which modules to recompute: (path in the model, module) -> recompute?
using ModulePicker = std::function<bool(const std::string& path, torch::nn::Module& module)>;
// Every module of type T (e.g. a transformer block).
template <class T>
ModulePicker of_type() {
  return [](const std::string&, torch::nn::Module& m) { return dynamic_cast<T*>(&m) != nullptr; };
}

// Activation checkpointing for every module `pick` selects under `root` (PyTorch's
// apply_activation_checkpointing), with no change to the model's code and no renamed parameter:
// each picked module gets forward hooks (a Hookable module, a dtrain::nn::Hooked<...> member, or a
// stock layer inside a torch::nn::Sequential, upgraded in place: Design note [hooked modules]) and
// then checkpoint_forward. A picked module's own children are not visited. Returns how many it
// checkpointed; picking none, or a module that cannot get hooks, is an error naming it.
int64_t checkpoint_modules(torch::nn::Module& root, const ModulePicker& pick);
// Undoes checkpoint_forward/checkpoint_modules on `root` and every module under it (the memory
// planner measures a model with and without recomputation). Returns how many modules it changed.
int64_t stop_recomputing(torch::nn::Module& root);

// Any module whose forward takes and returns one tensor (e.g. a transformer block).
template <class ModuleHolder>
class CheckpointWrapperImpl : public torch::nn::Module {
 public:
  explicit CheckpointWrapperImpl(ModuleHolder module) : module_(register_module("module", std::move(module))) {}
  at::Tensor forward(const at::Tensor& x) {
    if (!is_training()) return module_->forward(x);  // nothing to save for backward in eval
    auto m = module_;
    return checkpoint([m](const std::vector<at::Tensor>& in) mutable { return std::vector<at::Tensor>{m->forward(in[0])}; },
                      {x}, module_->parameters())[0];
  }
  ModuleHolder& module() { return module_; }

 private:
  ModuleHolder module_;
};

template <class ModuleHolder>
class CheckpointWrapper : public torch::nn::ModuleHolder<CheckpointWrapperImpl<ModuleHolder>> {
 public:
  using torch::nn::ModuleHolder<CheckpointWrapperImpl<ModuleHolder>>::ModuleHolder;
};

}  // namespace dtrain::recompute
