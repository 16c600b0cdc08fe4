#pragma once
// ShardedDataParallel: ZeRO-2 (sharded gradients) for libtorch modules, as FairScale's ShardedDDP
// and DeepSpeed's ZeRO stage 2, working with the ZeRO-1 optimizer (optim::ShardedOptimizer).
//
//   optim::ShardedOptimizer opt(net->parameters(), pg, make_adamw);   // decides who owns what
//   auto model = dtrain::ddp::ShardedDataParallel<Net>(net, pg, opt);
//   opt.zero_grad();
//   auto loss = loss_fn(model->forward(x), y);   // the wrapper owns forward (libtorch has no hooks)
//   loss.backward();   // each bucket reduce-scattered to the ranks that own its parameters
//   opt.step();        // owners step, then broadcast parameters
//   { auto guard = model->no_sync(); ... backward(); }  // accumulation: full local gradients, no comm
//
// After a synchronized backward a parameter's .grad is the average over ranks on the rank that
// owns it (opt.partition()) and undefined everywhere else. Gradient memory per rank is the owned
// gradients plus the buckets in flight: during backward each gradient is copied into its bucket's
// transient buffer as soon as autograd has produced it and, if another rank owns it, freed at
// once. Parameters are broadcast from rank 0 at construction (after checking every rank built the
// same model); names gain a "module." prefix, as with DistributedDataParallel.
//
// How (see Design note [backward hooks] in dtrain/util/autograd_hooks.h): parameters are bucketed
// as DistributedDataParallel does (reverse order, size cap, by dtype and device) and, inside a
// bucket, ordered by owner, so one flat reduce-scatter (comm::reduce_scatter, Avg) with per-rank
// counts (some zero) leaves each owner exactly its parameters' averaged gradients, in a persistent
// per-bucket `shard` that the owned .grad tensors alias. Buckets launch asynchronously, strictly in
// index order on every rank, from the gradient-ready hooks, overlapping the rest of backward; the
// end-of-backward callback waits for them and binds the owned gradients.
//
// Semantics as DistributedDataParallel + the plain optimizer, including gradients that are not
// zeroed between backward passes (accumulation without no_sync): an owned gradient that still holds
// an earlier average when a new backward reaches it is set aside in its slot and the new average is
// added to it (FSDP's saved gradient shard); zero_grad() in the middle of such an accumulation (after
// a backward that set an average aside, before the synchronized one) does not clear what was set
// aside. Not supported: parameters that get no gradient in a synchronized backward (an error names
// them; freeze them, or use them); a parameter of the module that the optimizer does not hold, or
// the reverse (an error at construction).
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/nn/wrapper.h"
#include "dtrain/util/no_sync_guard.h"
#include "dtrain/ddp/bucket.h"
#include "dtrain/ddp/comm_hook.h"
#include "dtrain/util/autograd_hooks.h"

namespace dtrain::optim {
class ShardedOptimizer;
}

namespace dtrain::ddp {

struct ShardedDataParallelOptions {
  // Bucket size cap (the first bucket is at most min(1 MiB, cap), so communication starts early).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  // Broadcast buffers (e.g. BatchNorm statistics) from rank 0 before every forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  // Broadcast parameters and buffers from rank 0 at construction.
  TORCH_ARG(bool, sync_module_states) = true;
  // Gradients sent in bf16 or fp16 (summed in fp32 where the backend sums locally): Design note
  // [gradient compression], ddp/comm_hook.h. Unset: in their own dtype.
  TORCH_ARG(c10::optional<at::ScalarType>, grad_compression) = c10::nullopt;
};

// A gradient bucket whose parameters are ordered by owner rank: part r of the flat buffer (by
// `counts`) is exactly rank r's parameters' gradients.
struct ShardedBucket {
  Bucket bucket;                // params (owner order), offsets, transient flat input `buffer`, state
  std::vector<int64_t> counts;  // per rank: elements of this bucket it owns (some zero)
  int64_t shard_begin = 0;      // offset of this rank's part in the flat buffer
  at::Tensor shard;             // this rank's part, persistent: its owned gradients live here
  at::Tensor scratch;           // transient output when an owned gradient carries an earlier average
};

// The gradient reduction behind ShardedDataParallel.
class ShardedReducer {
 public:
  // `params`: leaves that require grad (same order and shapes on every rank); `names` for errors;
  // `owners[i]`: the rank that keeps params[i]'s averaged gradient.
  ShardedReducer(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<int> owners,
                 comm::ProcessGroup pg, int64_t bucket_cap_bytes, int64_t first_bucket_cap_bytes,
                 c10::optional<at::ScalarType> compression = c10::nullopt);
  ~ShardedReducer();
  ShardedReducer(const ShardedReducer&) = delete;
  ShardedReducer& operator=(const ShardedReducer&) = delete;

  // After a forward whose backward should reduce gradients.
  void prepare_for_backward();

  const std::vector<ShardedBucket>& buckets() const { return buckets_; }
  const std::vector<at::Tensor>& params() const { return params_; }
  bool owns(size_t index) const { return owners_[index] == rank_; }
  // Elements of gradient this rank keeps between backward passes (the sum of its shards).
  int64_t owned_elements() const;

 private:
  // Per owned parameter: what its .grad holds (see the header comment on carried averages).
  enum class Owned {
    Local,    // .grad, if defined, is only this rank's own contributions (not reduced yet)
    Reduced,  // .grad is its slot in the shard, holding the average of the last reduction
    Carried,  // a backward reached it in Reduced with a non-zero average: the average stays in the
              // slot, .grad holds the new local part; the next reduction adds to the slot
  };
  void before_accumulate(size_t index);
  void on_grad_ready(size_t index);
  void launch_ready_buckets();
  void poll_in_flight();
  void finish(ShardedBucket& b);
  void finalize();
  std::string describe() const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<int> owners_;
  comm::ProcessGroup pg_;
  c10::optional<at::ScalarType> compression_;  // (the dtype gradients travel in; unset: their own)
  int rank_ = 0;
  std::vector<ShardedBucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // param -> (bucket, slot)
  std::vector<at::Tensor> slots_;                 // owned param -> its slot in its bucket's shard
  std::vector<Owned> owned_;                      // per param (meaningful for owned ones)
  std::vector<std::pair<size_t, unsigned>> pre_hooks_;  // (param, tensor hook handle)
  std::vector<char> ready_;
  size_t next_bucket_ = 0;  // buckets launch strictly in index order on every rank
  size_t first_in_flight_ = 0;
  util::BackwardRound round_;  // Idle -> Armed (forward) -> Reducing (backward) -> Idle
  std::mutex mu_;
  util::GradReadyHooks hooks_;  // last: removed before the state above goes away
};

// The non-template part of the wrapper (Design note [one wrapper template]).
class ShardedDataParallelState {
 public:
  // The optimizer decides who owns what: its partition() and params() (parameters are matched by
  // identity; every trainable parameter of `module` must be in it, and only those).
  ShardedDataParallelState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg,
                           const optim::ShardedOptimizer& optimizer, ShardedDataParallelOptions options = {});

  void attach(torch::nn::Module& wrapper) { wrapper.register_module("module", module_); }
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outputs);
  at::Tensor finish_output(at::Tensor out) { return out; }

  // RAII: while alive, backward accumulates full gradients locally and communicates nothing.
  using NoSyncGuard = util::NoSyncGuard;
  NoSyncGuard no_sync() { return NoSyncGuard(&sync_); }

  const comm::ProcessGroup& process_group() const { return pg_; }
  const ShardedReducer& reducer() const { return *reducer_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  comm::ProcessGroup pg_;
  ShardedDataParallelOptions options_;
  std::vector<at::Tensor> buffers_;
  std::unique_ptr<ShardedReducer> reducer_;
  bool sync_ = true;
};

// ShardedDataParallel<M>(module, pg, optimizer, options = {}): Design note [one wrapper template].
template <class ModuleHolder>
using ShardedDataParallelImpl = nn::WrapperImpl<ModuleHolder, ShardedDataParallelState>;
template <class ModuleHolder>
using ShardedDataParallel = nn::Wrapper<ModuleHolder, ShardedDataParallelState>;

}  // namespace dtrain::ddp
