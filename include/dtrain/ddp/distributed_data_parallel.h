#pragma once
// DistributedDataParallel for libtorch modules, as torch.nn.parallel.DistributedDataParallel.
//
//   auto pg = dtrain::comm::init_process_group();
//   auto model = dtrain::ddp::DistributedDataParallel<MyNet>(MyNet(...), pg);
//   auto loss = loss_fn(model->forward(x), y);   // wrapper owns forward (libtorch has no hooks)
//   loss.backward();                              // gradients averaged across ranks, in buckets
//   optimizer.step();
//   { auto guard = model->no_sync(); ... backward(); }  // gradient accumulation without comm
//
// At construction, parameters and buffers are broadcast from rank 0 (after checking that every
// rank built the same model). Parameter names gain a "module." prefix, as in PyTorch.
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/nn/collect_tensors.h"
#include "dtrain/util/no_sync_guard.h"
#include "dtrain/ddp/reducer.h"

namespace dtrain::ddp {

struct DistributedDataParallelOptions {
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  TORCH_ARG(double, first_bucket_cap_mb) = 1.0;
  // Search each forward's outputs for parameters that get no gradient this time.
  TORCH_ARG(bool, find_unused_parameters) = false;
  // Broadcast buffers (e.g. BatchNorm statistics) from rank 0 before every forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Gradients live in the communication buckets (no copies, less memory); see ReducerOptions.
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  // Broadcast parameters and buffers from rank 0 at construction.
  TORCH_ARG(bool, sync_module_states) = true;
};

// The non-template part of the wrapper: per-module DDP state.
class DataParallelState {
 public:
  DataParallelState(torch::nn::Module& module, comm::ProcessGroup pg, DistributedDataParallelOptions options);

  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);

  // RAII: while alive, backward accumulates gradients locally and communicates nothing.
  using NoSyncGuard = util::NoSyncGuard;
  NoSyncGuard no_sync() { return NoSyncGuard(&sync_); }

  const comm::ProcessGroup& process_group() const { return pg_; }
  const Reducer& reducer() const { return *reducer_; }

 private:
  torch::nn::Module& module_;
  comm::ProcessGroup pg_;
  DistributedDataParallelOptions options_;
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<Reducer> reducer_;
  bool sync_ = true;
};

using nn::collect_tensors;

template <class ModuleHolder>
class DistributedDataParallelImpl : public torch::nn::Module {
 public:
  DistributedDataParallelImpl(ModuleHolder module, comm::ProcessGroup pg,
                              DistributedDataParallelOptions options = {})
      : module_(register_module("module", std::move(module))),
        state_(std::make_unique<DataParallelState>(*module_.ptr(), std::move(pg), options)) {}

  template <class... Args>
  auto forward(Args&&... args) {
    state_->before_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> tensors;
    collect_tensors(out, tensors);
    state_->after_forward(tensors);
    return out;
  }

  DataParallelState::NoSyncGuard no_sync() { return state_->no_sync(); }
  ModuleHolder& module() { return module_; }
  DataParallelState& state() { return *state_; }

 private:
  ModuleHolder module_;
  std::unique_ptr<DataParallelState> state_;
};

// The module holder, as TORCH_MODULE would declare it (TORCH_MODULE cannot take a template).
template <class ModuleHolder>
class DistributedDataParallel : public torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleHolder>> {
 public:
  using torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleHolder>>::ModuleHolder;
};

}  // namespace dtrain::ddp
