#include "dtrain/ddp/sharded_data_parallel.h"

#include <algorithm>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/reduce_scatter.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "../internal/wrapper_common.h"

namespace dtrain::ddp {

// ---------------------------------------------------------------------------------------------
// ShardedReducer
//
// One backward, for a bucket b and a parameter i in it:
//   before autograd accumulates i's gradient (tensor hook, every backward, synced or not):
//     if i is owned here and its .grad still holds the last average (Owned::Reduced): zero (e.g.
//     after zero_grad) -> Local, autograd accumulates into the slot in place; non-zero -> Carried,
//     .grad undefined so autograd starts a fresh local gradient, the average stays in the slot.
//   i's gradient ready (post hook on its accumulator, synced backward only): copied into b's flat
//     buffer (allocated with b's first gradient); .grad freed unless it is i's slot here.
//   b complete, and every earlier bucket launched: reduce-scatter (Avg, counts) into b's shard,
//     or into a scratch part when an owned gradient is Carried.
//   b's reduce-scatter done (polled from later hooks, or waited for at the end of backward): flat
//     buffer freed, Carried slots += the new average (Local ones get it from scratch, or already
//     have it), owned .grad bound to their slots -> Reduced.
// ---------------------------------------------------------------------------------------------

ShardedReducer::ShardedReducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                               std::vector<int> owners, comm::ProcessGroup pg, int64_t bucket_cap_bytes,
                               int64_t first_bucket_cap_bytes, c10::optional<at::ScalarType> compression)
    : params_(std::move(params)), names_(std::move(names)), owners_(std::move(owners)), pg_(std::move(pg)),
      compression_(compression) {
  TORCH_CHECK(pg_.is_member(), "ShardedDataParallel: this rank is not a member of the process group");
  rank_ = pg_.rank();
  const int world = pg_.size();
  TORCH_CHECK(names_.size() == params_.size() && owners_.size() == params_.size(), describe(), " ",
              params_.size(), " parameters but ", names_.size(), " names and ", owners_.size(), " owners");
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].requires_grad() && params_[i].is_leaf(), describe(), " parameter ", names_[i],
                " must be a leaf that requires grad");
    TORCH_CHECK(owners_[i] >= 0 && owners_[i] < world, describe(), " parameter ", names_[i], " has owner rank ",
                owners_[i], " outside the group of ", world);
  }
  auto assignment = assign_buckets(params_, bucket_cap_bytes, first_bucket_cap_bytes);
  where_.resize(params_.size());
  slots_.resize(params_.size());
  buckets_.resize(assignment.size());
  for (size_t b = 0; b < assignment.size(); ++b) {
    ShardedBucket& sb = buckets_[b];
    Bucket& bucket = sb.bucket;
    bucket.params = assignment[b];
    // Owner order (stable: reverse registration order within an owner).
    std::stable_sort(bucket.params.begin(), bucket.params.end(),
                     [&](size_t x, size_t y) { return owners_[x] < owners_[y]; });
    bucket.lay_out(b, params_, where_);
    sb.counts.assign(world, 0);
    for (size_t p : bucket.params) sb.counts[owners_[p]] += params_[p].numel();
    sb.shard_begin = std::accumulate(sb.counts.begin(), sb.counts.begin() + rank_, int64_t{0});
    const auto& first = params_[bucket.params.front()];
    sb.shard = at::zeros({sb.counts[rank_]}, first.options().requires_grad(false));
    for (size_t slot = 0; slot < bucket.params.size(); ++slot) {
      const size_t p = bucket.params[slot];
      if (owns(p)) slots_[p] = internal::slot_alias(sb.shard, bucket.offsets[slot] - sb.shard_begin, params_[p]);
    }
  }
  owned_.assign(params_.size(), Owned::Local);
  ready_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    hooks_.add(params_[i], i, [this](size_t index) { on_grad_ready(index); });
    if (owns(i)) {
      pre_hooks_.emplace_back(i, params_[i].register_hook([this, i](const at::Tensor&) { before_accumulate(i); }));
    }
  }
}

ShardedReducer::~ShardedReducer() {
  for (const auto& [i, handle] : pre_hooks_) params_[i].remove_hook(handle);
}

std::string ShardedReducer::describe() const { return pg_.describe() + " ShardedDataParallel:"; }

int64_t ShardedReducer::owned_elements() const {
  int64_t n = 0;
  for (const auto& sb : buckets_) n += sb.shard.numel();
  return n;
}

void ShardedReducer::prepare_for_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  round_.arm(describe());  // first: throws before touching anything if still reducing
  std::fill(ready_.begin(), ready_.end(), 0);
  for (auto& sb : buckets_) {
    sb.bucket.state = BucketState::Waiting;
    sb.bucket.pending = sb.bucket.params.size();
    sb.bucket.work = comm::Work();
    sb.bucket.buffer = at::Tensor();
    sb.scratch = at::Tensor();
  }
  next_bucket_ = 0;
  first_in_flight_ = 0;
}

void ShardedReducer::before_accumulate(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (owned_[index] != Owned::Reduced) return;
  at::Tensor& grad = params_[index].mutable_grad();
  if (!internal::is_slot(grad, slots_[index])) {
    // Replaced or reset by the user since the reduction (e.g. zero_grad(set_to_none)): it is local.
    owned_[index] = Owned::Local;
  } else if (at::count_nonzero(grad).item<int64_t>() == 0) {
    owned_[index] = Owned::Local;  // zeroed: accumulate into the slot in place
  } else {
    owned_[index] = Owned::Carried;
    grad = at::Tensor();  // the average stays in the slot; autograd starts a fresh local gradient
  }
}

void ShardedReducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!round_.on_hook([this] { finalize(); })) return;  // no_sync, or no synced forward
  TORCH_CHECK(!ready_[index], describe(), " parameter ", names_[index],
              " received its gradient twice in one backward (a reused graph, retain_graph, or two "
              "forwards before one backward); run one forward per backward");
  ready_[index] = 1;
  poll_in_flight();  // release finished buckets before allocating more
  auto [b, slot] = where_[index];
  ShardedBucket& sb = buckets_[b];
  Bucket& bucket = sb.bucket;
  at::Tensor& param = params_[index];
  if (!bucket.buffer.defined()) {
    bucket.buffer = at::empty({bucket.offsets.back() + params_[bucket.params.back()].numel()},
                              param.options().requires_grad(false));
  }
  at::NoGradGuard no_grad;
  const bool mine = owns(index);
  at::Tensor local = param.grad();
  if (mine && owned_[index] == Owned::Reduced) {
    // Autograd produced no gradient this time (the pre-hook did not run): nothing local to add.
    owned_[index] = Owned::Carried;
    local = at::Tensor();
  }
  at::Tensor dst = bucket.buffer.narrow(0, bucket.offsets[slot], param.numel()).view(param.sizes());
  if (local.defined()) {
    dst.copy_(local);
  } else {
    dst.zero_();
  }
  // Free the full-size gradient now, unless it is this rank's slot (persistent anyway).
  if (!mine || !internal::is_slot(param.grad(), slots_[index])) param.mutable_grad() = at::Tensor();
  if (--bucket.pending == 0) bucket.transition(BucketState::Waiting, BucketState::Ready);
  launch_ready_buckets();
  poll_in_flight();
}

void ShardedReducer::launch_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].bucket.state == BucketState::Ready) {
    ShardedBucket& sb = buckets_[next_bucket_];
    bool carries = false;
    for (size_t p : sb.bucket.params) carries = carries || (owns(p) && owned_[p] == Owned::Carried);
    if (carries) sb.scratch = at::empty_like(sb.shard);
    at::Tensor& out = carries ? sb.scratch : sb.shard;
    sb.bucket.transition(BucketState::Ready, BucketState::InFlight);
    if (compression_) {  // (Design note [gradient compression], ddp/comm_hook.h)
      sb.bucket.work = compressed_reduce_scatter(pg_, out, sb.bucket.buffer, sb.counts, *compression_);
    } else {
      sb.bucket.work = comm::reduce_scatter(
          pg_, out, sb.bucket.buffer,
          comm::ReduceScatterOptions().op(comm::ReduceOp::Avg).counts(sb.counts).async_op(true));
    }
    ++next_bucket_;
  }
}

void ShardedReducer::poll_in_flight() {
  while (first_in_flight_ < next_bucket_ && buckets_[first_in_flight_].bucket.work.is_completed()) {
    finish(buckets_[first_in_flight_++]);
  }
}

void ShardedReducer::finish(ShardedBucket& sb) {
  sb.bucket.work.wait();
  // Release the flat input and the backend's own buffers (its work object holds them).
  sb.bucket.work = comm::Work();
  sb.bucket.buffer = at::Tensor();
  at::NoGradGuard no_grad;
  for (size_t slot = 0; slot < sb.bucket.params.size(); ++slot) {
    const size_t p = sb.bucket.params[slot];
    if (!owns(p)) continue;
    const at::Tensor& s = slots_[p];
    if (sb.scratch.defined()) {
      at::Tensor avg = sb.scratch.narrow(0, sb.bucket.offsets[slot] - sb.shard_begin, s.numel()).view(s.sizes());
      if (owned_[p] == Owned::Carried) {
        s.add_(avg);
      } else {
        s.copy_(avg);
      }
    }
    at::Tensor& grad = params_[p].mutable_grad();
    if (!internal::is_slot(grad, s)) grad = s;
    // Ready in this backward, so on_grad_ready moved it out of Reduced.
    TORCH_INTERNAL_ASSERT(owned_[p] != Owned::Reduced, describe(), " parameter ", names_[p],
                          " reduced twice without a backward reaching it");
    owned_[p] = Owned::Reduced;
  }
  sb.scratch = at::Tensor();
  sb.bucket.transition(BucketState::InFlight, BucketState::Reduced);
}

void ShardedReducer::finalize() {
  std::lock_guard<std::mutex> lock(mu_);
  round_.end();
  if (next_bucket_ < buckets_.size()) {
    const std::string missing = internal::list_names(names_, [&](size_t i) { return !ready_[i]; });
    // Drain what was launched so the process group stays usable.
    for (size_t b = first_in_flight_; b < next_bucket_; ++b) buckets_[b].bucket.work.wait();
    for (auto& sb : buckets_) {
      sb.bucket.buffer = at::Tensor();
      sb.scratch = at::Tensor();
    }
    TORCH_CHECK(false, describe(), " backward finished but these parameters got no gradient: ", missing,
                ". ShardedDataParallel needs a gradient for every trainable parameter in every "
                "synchronized backward: freeze the ones this model does not use (requires_grad false) "
                "before wrapping it and building the optimizer, or use DistributedDataParallel with "
                "find_unused_parameters(true).");
  }
  for (; first_in_flight_ < buckets_.size(); ++first_in_flight_) finish(buckets_[first_in_flight_]);
}

// ---------------------------------------------------------------------------------------------
// ShardedDataParallelState
// ---------------------------------------------------------------------------------------------

ShardedDataParallelState::ShardedDataParallelState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg,
                                                   const optim::ShardedOptimizer& optimizer,
                                                   ShardedDataParallelOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options) {
  TORCH_CHECK(module_, "ShardedDataParallel: no module given");
  TORCH_CHECK(pg_.is_member(), "ShardedDataParallel: this rank is not a member of the process group");
  TORCH_CHECK(options_.bucket_cap_mb() > 0, pg_.describe(), " ShardedDataParallel: bucket_cap_mb must be positive, got ",
              options_.bucket_cap_mb());
  const auto& partition = optimizer.partition();
  TORCH_CHECK(static_cast<int>(partition.elements.size()) == pg_.size(), pg_.describe(),
              " ShardedDataParallel: the optimizer partitions its parameters over ", partition.elements.size(),
              " rank(s) but the process group has ", pg_.size(), "; build the ShardedOptimizer and the wrapper ",
              "over the same process group");
  internal::WrappedTensors tensors = internal::wrapped_tensors(*module_);
  buffers_ = tensors.buffers;
  internal::sync_module_states(pg_, tensors, options_.sync_module_states(), "ShardedDataParallel");

  // Owners from the optimizer, parameters matched by identity.
  const auto& opt_params = optimizer.params();
  std::unordered_map<const void*, size_t> in_optimizer;
  for (size_t k = 0; k < opt_params.size(); ++k) in_optimizer.emplace(opt_params[k].unsafeGetTensorImpl(), k);
  std::vector<int> owners(tensors.params.size(), 0);
  std::vector<char> missing(tensors.params.size(), 0);
  std::unordered_set<const void*> in_module;
  for (size_t i = 0; i < tensors.params.size(); ++i) {
    in_module.insert(tensors.params[i].unsafeGetTensorImpl());
    auto it = in_optimizer.find(tensors.params[i].unsafeGetTensorImpl());
    if (it == in_optimizer.end()) {
      missing[i] = 1;
    } else {
      owners[i] = partition.owner.at(it->second);
    }
  }
  if (std::find(missing.begin(), missing.end(), 1) != missing.end()) {
    TORCH_CHECK(false, pg_.describe(), " ShardedDataParallel: these trainable parameters of the module are not in the ",
                "optimizer: ", internal::list_names(tensors.names, [&](size_t i) { return missing[i] != 0; }),
                ". Their gradients go to the rank the ShardedOptimizer assigns them to, so build it over every "
                "trainable parameter of the module (model->parameters()), or freeze these (requires_grad false)");
  }
  std::vector<size_t> extra;
  for (size_t k = 0; k < opt_params.size(); ++k) {
    if (opt_params[k].requires_grad() && !in_module.count(opt_params[k].unsafeGetTensorImpl())) extra.push_back(k);
  }
  if (!extra.empty()) {
    std::ostringstream os;
    for (size_t n = 0; n < extra.size() && n < 10; ++n) {
      os << (n ? ", " : "") << "#" << extra[n] << " " << opt_params[extra[n]].sizes();
    }
    TORCH_CHECK(false, pg_.describe(), " ShardedDataParallel: the optimizer holds ", extra.size(),
                " trainable parameter(s) that are not in the wrapped module (optimizer params() index and shape: ",
                os.str(), (extra.size() > 10 ? " ..." : ""), "); nobody would reduce their gradients. Build the ",
                "ShardedOptimizer over the wrapped module's parameters only");
  }
  const auto cap = static_cast<int64_t>(options_.bucket_cap_mb() * (1 << 20));
  reducer_ = std::make_unique<ShardedReducer>(std::move(tensors.params), std::move(tensors.names), std::move(owners),
                                              pg_, std::max<int64_t>(cap, 1),
                                              std::max<int64_t>(std::min<int64_t>(cap, 1 << 20), 1),
                                              options_.grad_compression());
}

void ShardedDataParallelState::before_forward() {
  if (options_.broadcast_buffers()) internal::broadcast_buffers(pg_, buffers_);
}

void ShardedDataParallelState::after_forward(const std::vector<at::Tensor>&) {
  if (sync_ && c10::GradMode::is_enabled()) reducer_->prepare_for_backward();
}

}  // namespace dtrain::ddp
