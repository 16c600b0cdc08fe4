#pragma once
// The gradient reducer behind DistributedDataParallel: buckets gradients as backward produces
// them and averages each bucket with an asynchronous all-reduce as soon as it is full, so
// communication overlaps the rest of backward. See Design note [backward hooks] in
// dtrain/util/autograd_hooks.h for how it hooks into libtorch's autograd.
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/ddp/bucket.h"
#include "dtrain/ddp/comm_hook.h"
#include "dtrain/util/autograd_hooks.h"

namespace dtrain::ddp {

struct ReducerOptions {
  TORCH_ARG(int64_t, bucket_cap_bytes) = 25 << 20;
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = 1 << 20;
  TORCH_ARG(bool, find_unused_parameters) = false;
  // Parameters' .grad become views into the bucket buffers (PyTorch's gradient_as_bucket_view):
  // no copy into the bucket before the all-reduce nor back after it, and no second copy of the
  // gradients in memory. A gradient that autograd replaced (e.g. zero_grad(set_to_none)) is
  // copied into its view once and re-bound to it.
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  // How each bucket is reduced (ddp/comm_hook.h: bf16, fp16, PowerSGD, or one's own); unset: an
  // all-reduce of the bucket as it is, then divided by the world size.
  TORCH_ARG(std::shared_ptr<CommHook>, comm_hook) = nullptr;
  // Without a hook: each bucket all-reduced in two levels where the group spans nodes with the same
  // number (> 1) of its ranks on each (comm::two_level_all_reduce; the construction splits the
  // group by node, a collective); elsewhere, and with a hook (which owns the reduction), flat.
  TORCH_ARG(bool, hierarchical_all_reduce) = false;
};

class Reducer {
 public:
  // `params`: leaves that require grad (same order and shapes on every rank); `names` for errors.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, comm::ProcessGroup pg,
          ReducerOptions options = {});

  // After a forward whose backward should average gradients. With find_unused_parameters,
  // `outputs` are searched for the parameters this backward will not reach.
  void prepare_for_backward(const std::vector<at::Tensor>& outputs);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  void on_grad_ready(size_t index);
  void mark_ready(size_t index, bool used);
  void launch_ready_buckets();
  void finalize();
  std::string describe() const;

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  comm::ProcessGroup pg_;
  ReducerOptions options_;
  comm::NodeGroups nodes_;  // (hierarchical_all_reduce: the group split by node)
  std::vector<at::Tensor> workspaces_;  // (and on Gloo: one per bucket, comm/two_level.h)
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // param -> (bucket, slot)
  std::vector<at::Tensor> slot_views_;            // param -> its slot in its bucket, shaped like it
  std::vector<char> ready_;
  std::vector<at::Tensor> stash_;  // gradients of locally unused parameters, kept while reducing
  at::Tensor locally_used_;  // int32 per parameter (find_unused_parameters)
  size_t next_bucket_ = 0;   // buckets launch strictly in index order on every rank
  util::BackwardRound round_;  // Idle -> Armed (forward) -> Reducing (backward) -> Idle
  std::mutex mu_;
  util::GradReadyHooks hooks_;  // last: removed before the state above goes away
};

}  // namespace dtrain::ddp
