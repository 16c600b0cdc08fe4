#pragma once
// One wrapper template for every data-parallel strategy: WrapperImpl<ModuleHolder, State> owns the
// forward call of a user's module and tells the strategy's State about it.
//
// Design note [one wrapper template]
// ----------------------------------
// libtorch modules have no forward hooks, so a data-parallel wrapper must own the forward call
// (PyTorch's DDP/FSDP hook it instead). The forward is a template over the module's own signature,
// so it lives in a header; everything else a strategy does is non-template and lives in its State
// (compiled once, in src/). DistributedDataParallel, ShardedDataParallel and FullyShardedDataParallel
// are this one template with their State:
//
//   template <class M> using DistributedDataParallel = nn::Wrapper<M, ddp::DataParallelState>;
//
// A State provides:
//   State(std::shared_ptr<torch::nn::Module> module, Args... args)   // the wrapper's extra arguments
//   void attach(torch::nn::Module& wrapper)       // what the wrapper registers: the module as child
//                                                 // "module" (DDP: names gain "module.", as in
//                                                 // PyTorch) or FSDP's flat shards
//   void before_forward()
//   void after_forward(const std::vector<at::Tensor>& outputs)   // every tensor of the output
//   at::Tensor finish_output(at::Tensor out)       // a single-tensor output, after after_forward
//                                                 // (FSDP's output_dtype); identity elsewhere
//   NoSyncGuard no_sync()
// The forward returns whatever the module's forward returns (a tensor, a tuple, a vector ...).
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "dtrain/nn/collect_tensors.h"

namespace dtrain::nn {

// `module`'s forward with `state` told about it: before_forward, the forward, after_forward with
// every tensor of the output, finish_output of a single-tensor output.
template <class State, class ModuleHolder, class... Args>
auto run_forward(State& state, ModuleHolder& module, Args&&... args) {
  state.before_forward();
  auto out = module->forward(std::forward<Args>(args)...);
  std::vector<at::Tensor> tensors;
  collect_tensors(out, tensors);
  state.after_forward(tensors);
  if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
    return state.finish_output(std::move(out));
  } else {
    return out;
  }
}

// A wrapper's State as values, for a caller that runs the module's forward itself
// (train::Parallel: whichever wrapper a plan puts around the model, one forward). Empty: nothing
// around the module.
struct ForwardAround {
  std::shared_ptr<torch::nn::Module> wrapper;  // keeps the wrapper, and so its State, alive
  std::function<void()> before;
  std::function<void(const std::vector<at::Tensor>&)> after;
  std::function<at::Tensor(at::Tensor)> finish;
  void before_forward() const {
    if (before) before();
  }
  void after_forward(const std::vector<at::Tensor>& outputs) const {
    if (after) after(outputs);
  }
  at::Tensor finish_output(at::Tensor out) const { return finish ? finish(std::move(out)) : out; }
};

template <class ModuleHolder, class State>
class WrapperImpl : public torch::nn::Module {
 public:
  // `args` go to State's constructor after the module (e.g. the process group and options).
  template <class... Args>
  explicit WrapperImpl(ModuleHolder module, Args&&... args)
      : module_(std::move(module)), state_(std::make_unique<State>(module_.ptr(), std::forward<Args>(args)...)) {
    state_->attach(*this);
  }

  template <class... Args>
  auto forward(Args&&... args) {
    return run_forward(*state_, module_, std::forward<Args>(args)...);
  }

  // The module may not be a registered child (FSDP): train/eval reach it here.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }

  // RAII: while the guard lives, backward accumulates gradients locally and communicates nothing.
  auto no_sync() { return state_->no_sync(); }
  ModuleHolder& module() { return module_; }
  State& state() { return *state_; }

 private:
  ModuleHolder module_;
  std::unique_ptr<State> state_;
};

// The module holder, as TORCH_MODULE would declare it (TORCH_MODULE cannot take a template).
template <class ModuleHolder, class State, class Impl = WrapperImpl<ModuleHolder, State>>
class Wrapper : public torch::nn::ModuleHolder<Impl> {
 public:
  using torch::nn::ModuleHolder<Impl>::ModuleHolder;
};

// The State of wrapper `holder` (a Wrapper<M, State>) as a ForwardAround.
template <class WrapperHolder>
ForwardAround around_of(const WrapperHolder& holder) {
  auto* impl = holder.ptr().get();
  ForwardAround a;
  a.wrapper = holder.ptr();
  a.before = [impl] { impl->state().before_forward(); };
  a.after = [impl](const std::vector<at::Tensor>& outputs) { impl->state().after_forward(outputs); };
  a.finish = [impl](at::Tensor out) { return impl->state().finish_output(std::move(out)); };
  return a;
}

}  // namespace dtrain::nn
