#include "dtrain/ddp/reducer.h"

#include <algorithm>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/two_level.h"
#include "../internal/wrapper_common.h"

namespace dtrain::ddp {

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, comm::ProcessGroup pg,
                 ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), pg_(std::move(pg)), options_(options) {
  TORCH_CHECK(names_.size() == params_.size(), "Reducer: ", names_.size(), " names for ", params_.size(),
              " parameters");
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].requires_grad() && params_[i].is_leaf(), describe(), " parameter ", names_[i],
                " must be a leaf that requires grad");
  }
  auto assignment = assign_buckets(params_, options_.bucket_cap_bytes(), options_.first_bucket_cap_bytes());
  where_.resize(params_.size());
  slot_views_.resize(params_.size());
  buckets_.resize(assignment.size());
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets_[b];
    bucket.params = assignment[b];
    const int64_t offset = bucket.lay_out(b, params_, where_);
    const auto& first = params_[bucket.params.front()];
    bucket.buffer = at::zeros({offset}, first.options().requires_grad(false));
    // Each parameter's slot, shaped like it (not an autograd view: see internal::slot_alias).
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t p = bucket.params[slot];
      slot_views_[p] = internal::slot_alias(bucket.buffer, bucket.offsets[slot], params_[p]);
    }
  }
  if (options_.hierarchical_all_reduce()) {
    nodes_ = comm::split_by_node(pg_);
    const auto& hook = options_.comm_hook();
    TORCH_CHECK(!hook || hook->use_nodes(pg_, nodes_), describe(), " --hierarchical-all-reduce: the communication hook ",
                hook ? hook->name() : "", " does not reduce in two levels (the bf16 and fp16 hooks do): use one or the other");
  }
  for (const Bucket& bucket : buckets_) {  // (Design note [two-level all-reduce]: kept from step to step)
    workspaces_.push_back(comm::two_level_uses_workspace(nodes_) && !options_.comm_hook()
                              ? at::empty({comm::two_level_workspace_numel(nodes_, bucket.buffer.numel())},
                                          bucket.buffer.options())
                              : at::Tensor());
  }
  ready_.assign(params_.size(), 0);
  stash_.resize(params_.size());
  locally_used_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.add(params_[i], i, [this](size_t index) { on_grad_ready(index); });
  }
}

std::string Reducer::describe() const { return pg_.describe() + " DistributedDataParallel:"; }

void Reducer::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  round_.arm(describe());  // first: throws before touching anything if still reducing
  std::fill(ready_.begin(), ready_.end(), 0);
  locally_used_.zero_();
  for (auto& bucket : buckets_) {
    bucket.state = BucketState::Waiting;
    bucket.pending = bucket.params.size();
    bucket.work = comm::Work();
  }
  next_bucket_ = 0;
  if (options_.find_unused_parameters()) {
    auto nodes = util::reachable_nodes(outputs);
    std::unordered_set<const torch::autograd::Node*> reachable(nodes.begin(), nodes.end());
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!reachable.count(hooks_.accumulator(i))) mark_ready(i, /*used=*/false);
    }
  }
}

void Reducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!round_.on_hook([this] { finalize(); })) return;  // no_sync, or no synced forward
  TORCH_CHECK(!ready_[index], describe(), " parameter ", names_[index],
              " received its gradient twice in one backward (reused graph, retain_graph or an "
              "unused parameter marked by find_unused_parameters that was used after all)");
  mark_ready(index, /*used=*/true);
  launch_ready_buckets();
}

void Reducer::mark_ready(size_t index, bool used) {
  ready_[index] = 1;
  auto [b, slot] = where_[index];
  Bucket& bucket = buckets_[b];
  at::Tensor& param = params_[index];
  const at::Tensor& view = slot_views_[index];
  const at::Tensor& grad = param.grad();
  const bool is_view = internal::is_slot(grad, view);
  if (is_view && !used) {
    // Its slot is all-reduced with the bucket; if no rank used it, finalize() puts it back.
    stash_[index] = view.clone();
  }
  if (!is_view) {
    if (grad.defined()) {
      view.copy_(grad);
    } else {
      view.zero_();
    }
    // Bind .grad to the view (an unused parameter keeps no gradient until it is known to be
    // used by some rank; see finalize()).
    if (options_.gradient_as_bucket_view() && (used || grad.defined())) param.mutable_grad() = view;
  }
  if (used) locally_used_[index] = 1;
  if (--bucket.pending == 0) bucket.transition(BucketState::Waiting, BucketState::Ready);
}

void Reducer::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].state == BucketState::Ready) {
    Bucket& bucket = buckets_[next_bucket_];
    bucket.transition(BucketState::Ready, BucketState::InFlight);
    // (two levels: the bucket before goes on to its across level while backward goes on; Design
    // note [two-level all-reduce])
    if (next_bucket_ > 0) buckets_[next_bucket_ - 1].work.advance();
    if (const auto& hook = options_.comm_hook()) {  // (leaves the mean: Design note [gradient compression])
      GradBucket b{next_bucket_, bucket.buffer, {}, next_bucket_ + 1 == buckets_.size()};
      for (size_t p : bucket.params) b.grads.push_back(slot_views_[p]);
      bucket.work = hook->reduce(pg_, b);
    } else {
      bucket.work = comm::two_level_all_reduce(pg_, nodes_, bucket.buffer, comm::AllReduceOptions().async_op(true),
                                               workspaces_[next_bucket_]);
    }
    ++next_bucket_;
  }
}

void Reducer::finalize() {
  std::lock_guard<std::mutex> lock(mu_);
  round_.end();
  if (next_bucket_ < buckets_.size()) {
    const std::string missing = internal::list_names(names_, [&](size_t i) { return !ready_[i]; });
    // Drain what was launched so the process group stays usable.
    for (size_t b = 0; b < next_bucket_; ++b) buckets_[b].work.wait();
    TORCH_CHECK(false, describe(), " backward finished but these parameters got no gradient: ",
                missing,
                ". If the model does not use every parameter in every forward, construct it with "
                "DistributedDataParallelOptions().find_unused_parameters(true); if it was on purpose, "
                "freeze them (requires_grad false) before wrapping.");
  }
  comm::Work used_work;
  at::Tensor globally_used;
  if (options_.find_unused_parameters()) {
    globally_used = locally_used_.to(pg_.device(), /*non_blocking=*/false, /*copy=*/true);  // NCCL: CUDA only
    used_work = comm::all_reduce(pg_, globally_used, comm::AllReduceOptions().op(comm::ReduceOp::Max).async_op(true));
  }
  for (auto& bucket : buckets_) bucket.work.wait();
  used_work.wait();
  if (globally_used.defined()) globally_used = globally_used.cpu();  // read element by element below
  at::NoGradGuard no_grad;
  const double inv_world = 1.0 / pg_.size();
  for (auto& bucket : buckets_) {
    if (!options_.comm_hook()) bucket.buffer.mul_(inv_world);
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t p = bucket.params[slot];
      at::Tensor& param = params_[p];
      if (globally_used.defined() && globally_used[p].item<int>() == 0) {
        // No rank used it: its gradient stays as it was, as in PyTorch.
        if (stash_[p].defined()) slot_views_[p].copy_(stash_[p]);
        stash_[p] = at::Tensor();
        continue;
      }
      stash_[p] = at::Tensor();
      const at::Tensor& avg = slot_views_[p];
      if (options_.gradient_as_bucket_view()) {
        if (!param.grad().defined() || param.grad().data_ptr() != avg.data_ptr()) param.mutable_grad() = avg;
      } else if (param.grad().defined()) {
        param.mutable_grad().copy_(avg);
      } else {
        param.mutable_grad() = avg.clone();
      }
    }
    bucket.transition(BucketState::InFlight, BucketState::Reduced);
  }
}

}  // namespace dtrain::ddp
