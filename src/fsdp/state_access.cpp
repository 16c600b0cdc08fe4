#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/fsdp/train_state.h"

// FullyShardedState, what is read or written outside an iteration: the shards, clipping, full and
// sharded state dicts, weight export, memory accounting.

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "../internal/wrapper_common.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/nn/forward_hooks.h"
#include "dtrain/nn/hooked.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/util/system.h"

namespace dtrain::fsdp {

// ---------------------------------------------------------------------------------------------
// Shards, clipping, state dicts

void FullyShardedState::attach(torch::nn::Module& wrapper) {
  auto shards = trainable_shards();
  for (size_t i = 0; i < shards.size(); ++i) wrapper.register_parameter("flat_param_" + std::to_string(i), shards[i]);
}

std::vector<at::Tensor> FullyShardedState::trainable_shards() const {
  std::vector<at::Tensor> out;
  for (auto* f : all_flats_) {
    if (f->trainable()) out.push_back(f->shard());
  }
  return out;
}

std::vector<at::Tensor> FullyShardedState::shards() const {
  std::vector<at::Tensor> out;
  for (auto* f : all_flats_) out.push_back(f->shard());
  return out;
}

std::vector<ShardSlice> FullyShardedState::slices() const {
  std::vector<ShardSlice> out;
  for (const auto& np : named_) {
    const FlatParam& f = *np.flat;
    auto [b, e] = f.local_range(np.entry);
    if (e == b) continue;
    const size_t flat = std::find(all_flats_.begin(), all_flats_.end(), np.flat) - all_flats_.begin();
    const auto& entry = f.entries()[np.entry];
    out.push_back({np.name, entry.shape, b, e - b, flat, entry.offset + b - f.shard_begin()});
  }
  return out;
}

std::vector<FullyShardedState::ParamInfo> FullyShardedState::parameter_infos() const {
  std::vector<ParamInfo> out;
  for (const auto& np : named_) {
    out.push_back({np.name, np.flat->entries()[np.entry].shape, np.flat->shard().scalar_type()});
  }
  return out;
}

double FullyShardedState::clip_grad_norm(double max_norm, double norm_type) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": clip_grad_norm during forward/backward; call it after backward()");
  // Within a shard group every element is held by exactly one rank (padding has zero gradient);
  // replicas hold the same shards, so the shard group alone gives the global norm.
  return optim::clip_grad_norm(groups_.shard, trainable_shards(), max_norm, norm_type);
}

at::Tensor FullyShardedState::gather_master(const FlatParam& f) const {
  const auto opts = f.shard().options().requires_grad(false);
  if (groups_.layout.shard == 1) return f.shard().detach().clone();
  // On the group's device (offloaded shards go there and back).
  const auto dev = groups_.shard.device();
  at::Tensor full = at::empty({f.chunk() * groups_.layout.shard}, opts.device(dev));
  comm::all_gather(groups_.shard, full, f.shard().detach().to(dev));
  return full.to(opts.device());
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedState::full_state_dict(int rank) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": full_state_dict during forward/backward");
  TORCH_CHECK(rank >= 0 && rank < groups_.data.size(), describe(), ": full_state_dict rank ", rank, " out of range");
  const bool keep = groups_.data.rank() == rank;
  std::vector<at::Tensor> values(named_.size());
  for (auto* f : all_flats_) {
    at::Tensor full = gather_master(*f);  // one unit's FlatParam at a time
    if (!keep) continue;
    for (size_t i = 0; i < named_.size(); ++i) {
      if (named_[i].flat != f) continue;
      const auto& e = f->entries()[named_[i].entry];
      values[i] = full.narrow(0, e.offset, e.numel).view(e.shape).clone();
    }
  }
  torch::OrderedDict<std::string, at::Tensor> out;
  if (!keep) return out;
  for (size_t i = 0; i < named_.size(); ++i) out.insert(named_[i].name, values[i]);
  for (const auto& [name, b] : buffers_) out.insert(name, b.detach().clone());
  return out;
}

void FullyShardedState::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": load_full_state_dict during forward/backward");
  // Check everything before changing anything.
  for (const auto& np : named_) {
    const auto* v = dict.find(np.name);
    TORCH_CHECK(v, describe(), " load_full_state_dict: missing key ", np.name);
    const auto& e = np.flat->entries()[np.entry];
    TORCH_CHECK(v->sizes().vec() == e.shape, describe(), " load_full_state_dict: ", np.name, " has shape ",
                v->sizes(), ", the model ", c10::IntArrayRef(e.shape));
  }
  for (const auto& [name, b] : buffers_) {
    const auto* v = dict.find(name);
    TORCH_CHECK(v && v->sizes() == b.sizes(), describe(), " load_full_state_dict: buffer ", name,
                v ? " has the wrong shape" : " is missing");
  }
  for (auto& u : units_) u->reshard();
  for (const auto& np : named_) np.flat->load(np.entry, dict[np.name]);
  at::NoGradGuard no_grad;
  for (auto& [name, b] : buffers_) b.copy_(dict[name]);
}

std::string FullyShardedState::export_full_weights(const std::string& path, int rank,
                                                   std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": export_full_weights during forward/backward");
  TORCH_CHECK(rank >= 0 && rank < groups_.world.size(), describe(), ": export_full_weights rank ", rank, " out of range");
  const bool mine = groups_.world.rank() == rank;
  std::unique_ptr<checkpoint::StreamingWriter> writer;
  if (mine) {
    std::vector<checkpoint::TensorSpec> specs;
    for (auto* f : all_flats_) {
      for (const auto& e : f->entries()) specs.push_back({e.name, e.shape, dtype.value_or(f->shard().scalar_type())});
    }
    for (const auto& [name, b] : buffers_) specs.push_back({name, b.sizes().vec(), b.scalar_type()});
    writer = std::make_unique<checkpoint::StreamingWriter>(path, std::move(specs));
  }
  for (auto* f : all_flats_) {
    at::Tensor full = gather_master(*f);
    if (!mine) continue;
    for (const auto& e : f->entries()) {
      at::Tensor v = full.narrow(0, e.offset, e.numel);
      writer->write(e.name, dtype ? v.to(*dtype) : v);
    }
  }
  if (!mine) return "";
  for (const auto& [name, b] : buffers_) writer->write(name, b.detach());
  return writer->finish().path;
}

std::vector<checkpoint::Piece> FullyShardedState::sharded_state_dict(const std::string& prefix) const {
  // Replicas (HybridShard, NoShard) hold equal shards: the first replica writes them (shard_view),
  // so every element is written once.
  std::vector<checkpoint::Piece> out = snapshot_params(shard_view(*this), prefix);
  for (const auto& [name, buf] : buffers_) {
    if (auto p = checkpoint::replicated_piece(prefix + name, buf.detach(), groups_.world.rank(), groups_.world.size())) {
      out.push_back(std::move(*p));
    }
  }
  return out;
}

void FullyShardedState::load_sharded_state_dict(const RangeReader& read, const std::string& prefix) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": load_sharded_state_dict during forward/backward");
  for (auto& u : units_) u->reshard();
  at::NoGradGuard no_grad;
  for (const auto& np : named_) {
    auto [b, e] = np.flat->local_range(np.entry);
    if (e == b) continue;
    at::Tensor v = read(prefix + np.name, b, e);
    TORCH_CHECK(v.numel() == e - b, describe(), " load_sharded_state_dict: ", prefix + np.name, " [", b, ", ", e,
                ") came back with ", v.numel(), " elements");
    np.flat->local_part(np.entry).copy_(v.reshape({-1}));
  }
  for (auto& [name, buf] : buffers_) buf.copy_(read(prefix + name, 0, buf.numel()).view(buf.sizes()));
}

FullyShardedState::GatheredGuard::GatheredGuard(FullyShardedState* s) : s_(s) {
  TORCH_CHECK(s_->phase_ == Phase::Idle, s_->describe(), ": gather_full_params during forward/backward");
  for (auto& u : s_->units_) s_->gather(*u, /*wait=*/false);
  for (auto& u : s_->units_) s_->gather(*u, /*wait=*/true);
}

FullyShardedState::GatheredGuard::~GatheredGuard() {
  if (!s_) return;
  for (auto& u : s_->units_) u->reshard();
}

int64_t FullyShardedState::owned_bytes() const {
  int64_t n = pool_->held_bytes();
  for (auto* f : all_flats_) n += f->owned_bytes();
  return n;
}

int64_t FullyShardedState::pooled_bytes() const { return pool_->held_bytes(); }

void FullyShardedState::note_memory() { peak_owned_bytes_ = std::max(peak_owned_bytes_, owned_bytes()); }

}  // namespace dtrain::fsdp
