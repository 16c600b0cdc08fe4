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
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "dtrain/nn/collect_tensors.h"

namespace dtrain::nn {

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
    state_->before_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    collect_tensors(out, tensors);
    state_->after_forward(tensors);
    if constexpr (std::is_same_v<decltype(out), at::Tensor>) {
      return state_->finish_output(std::move(out));
    } else {
      return out;
    }
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

}  // namespace dtrain::nn
