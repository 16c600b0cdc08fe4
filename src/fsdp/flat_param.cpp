#include "dtrain/fsdp/flat_param.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include "../internal/wrapper_common.h"
#include "collectives.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/reduce_scatter.h"

namespace dtrain::fsdp {

void alloc_storage(const at::Tensor& t, size_t nbytes, BlockPool* pool) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == nbytes) return;
  TORCH_CHECK(s->nbytes() == 0, "FSDP: internal error: re-allocating a full buffer that is still allocated");
  const c10::OptionalDeviceGuard on(t.device());  // (a CUDA allocator allocates on the current device)
  s->set_data_ptr_noswap(pool ? pool->take(nbytes, s->allocator()) : s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

FlatParam::FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names, const ShardGroups& groups,
                     at::ScalarType compute_dtype, at::ScalarType reduce_dtype, std::string unit_name,
                     BlockPool* pool, bool cpu_offload, Quantization quant, SecondaryShard secondary)
    : unit_name_(std::move(unit_name)), groups_(&groups), pool_(pool), quant_(quant), secondary_(secondary),
      compute_dtype_(compute_dtype), reduce_dtype_(reduce_dtype) {
  TORCH_CHECK(!params.empty() && params.size() == names.size(), "FlatParam: ", params.size(), " parameters, ",
              names.size(), " names");
  master_dtype_ = params[0].scalar_type();
  trainable_ = params[0].requires_grad();
  const auto device = params[0].device();
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].scalar_type() == master_dtype_ && params[i].requires_grad() == trainable_ &&
                    params[i].device() == device,
                "FlatParam ", unit_name_, ": parameter ", names[i], " differs in dtype, device or requires_grad");
    Entry e;
    e.name = std::move(names[i]);
    e.param = params[i];
    e.shape = params[i].sizes().vec();
    e.numel = params[i].numel();
    e.offset = numel_;
    numel_ += e.numel;
    entries_.push_back(std::move(e));
  }
  shard_size_ = groups.shard.size();
  shard_rank_ = groups.shard.rank();
  chunk_ = (numel_ + shard_size_ - 1) / shard_size_;
  device_ = device;
  auto master = at::TensorOptions().dtype(master_dtype_).device(cpu_offload ? at::Device(at::kCPU) : device);
  shard_ = at::zeros({chunk_}, master);
  shard_.set_requires_grad(trainable_);
  aliased_ = shard_size_ == 1 && compute_dtype_ == master_dtype_ && shard_.device() == device_;
  if (aliased_) {
    full_ = shard_.detach();
  } else {
    full_ = at::empty({chunk_ * shard_size_}, master.dtype(compute_dtype_).device(device_));
    util::give_back(full_, nullptr);
  }
  at::NoGradGuard no_grad;
  bind_placeholders();
}

int64_t FlatParam::full_bytes() const { return chunk_ * shard_size_ * static_cast<int64_t>(c10::elementSize(compute_dtype_)); }

int64_t FlatParam::owned_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0; };
  int64_t n = bytes(shard_) + bytes(shard_.grad());
  if (!aliased_) n += bytes(full_);  // zero while released
  n += bytes(grad_flat_);
  if (grad_shard_.defined() && !grad_shard_.is_same(grad_flat_)) n += bytes(grad_shard_);
  n += bytes(workspace_) + bytes(gather_workspace_) + bytes(node_copy_);
  if (send_pooled_) n += bytes(send_);
  if (!grad_flat_.defined()) {
    for (const auto& e : entries_) n += bytes(e.param.grad());
  }
  return n;
}

std::pair<int64_t, int64_t> FlatParam::local_range(size_t i) const {
  const Entry& e = entries_.at(i);
  const int64_t lo = std::max(e.offset, shard_begin());
  const int64_t hi = std::min(e.offset + e.numel, shard_begin() + chunk_);
  if (hi <= lo) return {0, 0};
  return {lo - e.offset, hi - e.offset};
}

at::Tensor FlatParam::local_part(size_t i) const {
  auto [b, e] = local_range(i);
  const int64_t at_shard = entries_.at(i).offset + b - shard_begin();
  return shard_.detach().narrow(0, std::max<int64_t>(at_shard, 0), e - b);
}

void FlatParam::load(size_t i, const at::Tensor& full_value) {
  const Entry& e = entries_.at(i);
  TORCH_CHECK(full_value.numel() == e.numel, "FSDP unit ", unit_name_, ": value for ", e.name, " has ",
              full_value.numel(), " elements, the parameter ", e.numel, " (shape ", c10::IntArrayRef(e.shape), ")");
  auto [b, end] = local_range(i);
  if (end == b) return;
  at::NoGradGuard no_grad;
  local_part(i).copy_(full_value.reshape({-1}).narrow(0, b, end - b));
}

void FlatParam::bind_views() {
  for (auto& e : entries_) e.param.set_data(full_.narrow(0, e.offset, e.numel).view(e.shape));
}

void FlatParam::bind_placeholders() {
  auto opts = at::TensorOptions().dtype(compute_dtype_).device(full_.device());
  for (auto& e : entries_) e.param.set_data(at::empty({0}, opts));
}

void FlatParam::release() {
  at::NoGradGuard no_grad;
  node_copy_ = at::Tensor();
  if (state_ == State::NodeSharded) state_ = State::Sharded;
  const auto opts = at::TensorOptions().dtype(master_dtype_).device(device_);
  for (auto& e : entries_) {
    e.param.mutable_grad() = at::Tensor();
    e.param.set_data(at::zeros(e.shape, opts));
  }
}

void FlatParam::bind_stand_ins() {
  at::NoGradGuard no_grad;
  auto opts = at::TensorOptions().dtype(compute_dtype_).device(full_.device());
  for (auto& e : entries_) e.param.set_data(at::zeros({}, opts).expand(e.shape));
}

void FlatParam::gather_async() {
  if (state_ != State::Sharded && state_ != State::NodeSharded) return;
  at::NoGradGuard no_grad;
  if (aliased_) {
    state_ = State::Gathering;
    return;
  }
  alloc_storage(full_, static_cast<size_t>(full_bytes()), pool_);
  if (state_ == State::NodeSharded) {  // Design note [secondary shards]: inside the node
    const comm::ProcessGroup& within = groups_->shard_nodes.within;
    send_ = std::move(node_copy_);
    node_copy_ = at::Tensor();
    send_pooled_ = true;
    if (comm::all_gather_uses_workspace(within)) gather_workspace_ = pooled_empty(full_.numel(), full_.options(), pool_);
    gather_work_ = collectives::all_gather_node_copy(*groups_, send_, full_, gather_workspace_);
    state_ = State::Gathering;
    return;
  }
  // The shard as sent: itself, or a cast copy (mixed precision, CPU offload) from the pool.
  send_pooled_ = shard_.scalar_type() != full_.scalar_type() || shard_.device() != full_.device();
  if (send_pooled_) {
    send_ = pooled_empty(chunk_, full_.options(), pool_);
    send_.copy_(shard_);
  } else {
    send_ = shard_.detach();
  }
  if (shard_size_ > 1 && !quant_.gathers() && comm::all_gather_uses_workspace(groups_->shard)) {
    gather_workspace_ = pooled_empty(chunk_ * shard_size_, full_.options(), pool_);
  }
  gather_work_ = collectives::all_gather_shard(*groups_, send_, full_, gather_workspace_, quant_, pool_);
  state_ = State::Gathering;
}

void FlatParam::wait_gather() {
  if (state_ == State::Gathered) return;
  TORCH_CHECK(state_ == State::Gathering, "FSDP unit ", unit_name_, ": waiting for a gather that was not started");
  try {
    gather_work_.wait();
  } catch (...) {
    abandon_gather();
    throw;
  }
  gather_work_ = comm::Work();
  if (send_pooled_) util::give_back(send_, pool_);
  if (gather_workspace_.defined()) util::give_back(gather_workspace_, pool_);
  gather_workspace_ = at::Tensor();
  send_ = at::Tensor();
  send_pooled_ = false;
  at::NoGradGuard no_grad;
  bind_views();
  state_ = State::Gathered;
}

void FlatParam::reshard(bool for_backward) {
  if (state_ == State::Sharded) return;
  if (state_ == State::NodeSharded) {
    if (!for_backward) drop_node_copy();
    return;
  }
  if (state_ == State::Gathering) wait_gather();
  if (aliased_) return;  // the full buffer is the master shard: nothing to free
  at::NoGradGuard no_grad;
  const bool keep = for_backward && keeps_node_copy();
  if (keep) {  // Design note [secondary shards]: this rank's part of the node's copy
    const int64_t part = full_.numel() / groups_->shard_nodes.within.size();
    node_copy_ = pooled_empty(part, full_.options(), pool_);
    node_copy_.copy_(full_.narrow(0, part * groups_->shard_nodes.within.rank(), part));
  }
  bind_placeholders();
  util::give_back(full_, pool_);
  state_ = keep ? State::NodeSharded : State::Sharded;
}

bool FlatParam::keeps_node_copy() const {
  return secondary_ == SecondaryShard::Node && shard_size_ > 1 && groups_->shard_nodes.two_level();
}

void FlatParam::drop_node_copy() {
  if (node_copy_.defined()) util::give_back(node_copy_, pool_);
  node_copy_ = at::Tensor();
  state_ = State::Sharded;
}

at::Tensor FlatParam::new_grad_buffer() {
  return pooled_empty(chunk_ * shard_size_, at::TensorOptions().dtype(reduce_dtype_).device(device_), pool_);
}

void FlatParam::bind_grad_slots() {
  if (!trainable_ || reducing_ || reduce_dtype_ != compute_dtype_) return;
  at::NoGradGuard no_grad;
  if (!grad_flat_.defined()) {
    grad_flat_ = new_grad_buffer();
    grad_flat_.zero_();
  }
  for (auto& e : entries_) {
    at::Tensor& g = e.param.mutable_grad();
    at::Tensor slot = grad_flat_.narrow(0, e.offset, e.numel);
    if (g.defined() && internal::is_slot(g, slot)) continue;
    if (g.defined()) slot.add_(g.reshape({-1}));  // accumulated before binding (e.g. under no_sync)
    g = internal::slot_alias(grad_flat_, e.offset, e.param);
  }
}

void FlatParam::reduce_grads_async() {
  TORCH_CHECK(!reducing_, "FSDP unit ", unit_name_, ": a gradient reduction is already in flight");
  at::NoGradGuard no_grad;
  if (grad_flat_.defined()) {
    // Bound slots (bind_grad_slots): autograd accumulated in place; fold in anything else.
    for (auto& e : entries_) {
      at::Tensor& g = e.param.mutable_grad();
      at::Tensor slot = grad_flat_.narrow(0, e.offset, e.numel);
      if (!g.defined()) {
        slot.zero_();  // set to None by the caller since binding
      } else if (!internal::is_slot(g, slot)) {
        slot.copy_(g.reshape({-1}));
      }
      g = at::Tensor();
    }
  } else {
    // Every element written once: the gradients, zeros where a parameter has none, the padding.
    grad_flat_ = new_grad_buffer();
    for (auto& e : entries_) {
      at::Tensor& g = e.param.mutable_grad();
      auto slot = grad_flat_.narrow(0, e.offset, e.numel);
      if (g.defined()) {
        slot.copy_(g.reshape({-1}));
        g = at::Tensor();
      } else {
        slot.zero_();
      }
    }
    grad_flat_.narrow(0, numel_, grad_flat_.numel() - numel_).zero_();
  }
  if (shard_size_ > 1) {
    grad_shard_ = pooled_empty(chunk_, grad_flat_.options(), pool_);
    if (!quant_.reductions() && comm::reduce_scatter_uses_workspace(groups_->shard)) workspace_ = new_grad_buffer();
  }
  reduce_work_ = collectives::reduce_scatter_grad(*groups_, grad_flat_, grad_shard_, workspace_, quant_, pool_);
  reducing_ = true;
}

void FlatParam::finish_reduce() {
  if (!reducing_) return;
  try {
    reduce_work_.wait();
  } catch (...) {
    abandon_reduction();
    throw;
  }
  reduce_work_ = comm::Work();
  if (shard_size_ > 1) util::give_back(grad_flat_, pool_);  // (with one shard it is grad_shard_)
  grad_flat_ = at::Tensor();
  if (workspace_.defined()) util::give_back(workspace_, pool_);
  workspace_ = at::Tensor();
  at::NoGradGuard no_grad;
  try {
    collectives::all_reduce_replicas(*groups_, grad_shard_, quant_, pool_);
  } catch (...) {
    abandon_reduction();
    throw;
  }
  accumulate_reduced();
  util::give_back(grad_shard_, pool_);  // (a block of the pool, in every case)
  grad_shard_ = at::Tensor();
  reducing_ = false;
}

// A collective that failed (a dead peer, an aborted group) may still be running on the backend's
// thread, writing into its buffers: they are dropped, never given back to the pool, where another
// buffer could take them meanwhile (the backend's work holds their storages: Design note
// [aborting a group's waits], comm/abort.h). The unit goes back to Sharded, its full buffer a new
// storage.
void FlatParam::abandon_gather() {
  gather_work_ = comm::Work();
  node_copy_ = at::Tensor();
  send_ = gather_workspace_ = at::Tensor();
  send_pooled_ = false;
  if (!aliased_) {
    full_ = at::empty({chunk_ * shard_size_}, full_.options());
    util::give_back(full_, nullptr);
  }
  state_ = State::Sharded;
}

void FlatParam::abandon_reduction() {
  grad_flat_ = workspace_ = grad_shard_ = at::Tensor();
  reducing_ = false;
}

// Adds the reduced shard to shard().grad; a gradient made here is a fresh tensor, never the pool's
// block (Design note [buffers reused]).
void FlatParam::accumulate_reduced() {
  at::Tensor& acc = shard_.mutable_grad();
  if (acc.defined() && acc.device() == grad_shard_.device()) {
    acc.add_(grad_shard_);  // (a reduced dtype is promoted to the master's)
    return;
  }
  at::Tensor g = grad_shard_.to(shard_.device(), master_dtype_, /*non_blocking=*/false, /*copy=*/true);
  if (acc.defined()) {
    acc.add_(g);
  } else {
    acc = g;
  }
}

}  // namespace dtrain::fsdp
