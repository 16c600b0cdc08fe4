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
#include "dtrain/nn/wrapper.h"
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
  // How each gradient bucket is reduced (ddp/comm_hook.h; PyTorch's register_comm_hook).
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;
  // Where the group spans nodes, each bucket all-reduced inside the node first and across nodes
  // once (Design note [two-level all-reduce], comm/two_level.h); see ReducerOptions.
  TORCH_ARG(bool, hierarchical_all_reduce) = false;
};

// The non-template part of the wrapper: per-module DDP state (Design note [one wrapper template]).
class DataParallelState {
 public:
  DataParallelState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg,
                    DistributedDataParallelOptions options = {});

  void attach(torch::nn::Module& wrapper) { wrapper.register_module("module", module_); }
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);
  at::Tensor finish_output(at::Tensor out) { return out; }

  // RAII: while alive, backward accumulates gradients locally and communicates nothing.
  using NoSyncGuard = util::NoSyncGuard;
  NoSyncGuard no_sync() { return NoSyncGuard(&sync_); }

  const comm::ProcessGroup& process_group() const { return pg_; }
  const Reducer& reducer() const { return *reducer_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  comm::ProcessGroup pg_;
  DistributedDataParallelOptions options_;
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<Reducer> reducer_;
  bool sync_ = true;
};

using nn::collect_tensors;

// DistributedDataParallel<M>(module, pg, options = {}): Design note [one wrapper template].
template <class ModuleHolder>
using DistributedDataParallelImpl = nn::WrapperImpl<ModuleHolder, DataParallelState>;
template <class ModuleHolder>
using DistributedDataParallel = nn::Wrapper<ModuleHolder, DataParallelState>;

}  // namespace dtrain::ddp
