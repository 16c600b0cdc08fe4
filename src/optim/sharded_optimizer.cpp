#include "dtrain/optim/sharded_optimizer.h"

#include <algorithm>

#include <c10/util/Exception.h>

#include <ATen/ATen.h>

#include "dtrain/comm/broadcast.h"
#include "dtrain/comm/send_recv.h"

namespace dtrain::optim {

namespace {

std::vector<at::Tensor> pick(const std::vector<at::Tensor>& all, const std::vector<size_t>& idx) {
  std::vector<at::Tensor> out;
  out.reserve(idx.size());
  for (size_t i : idx) out.push_back(all[i]);
  return out;
}

// Runs `fn`; a c10::Error from it is rethrown naming the rank and the operation.
template <class Fn>
auto with_rank(const comm::ProcessGroup& pg, const char* op, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, pg.describe(), " ShardedOptimizer::", op, ": ", e.msg());
  }
}

// consolidate_state_dict's wire format. Per owning rank r (its parameters by_rank[r], j-th here):
// a header of 2 int64 per parameter, [mask, step] (mask bit 0: has state; bit f+1: field f of
// state_fields(kind) present), then one flat tensor per dtype bucket holding the present non-step
// fields, parameter by parameter, field by field. Both sides derive the buckets from the header.
struct Slot {
  size_t j;           // position among the owner's parameters
  std::string field;
};
struct Bucket {
  at::ScalarType dtype;
  std::vector<Slot> slots;
  int64_t numel = 0;
};

std::vector<Bucket> layout(const std::vector<int64_t>& header, const std::vector<at::Tensor>& owned,
                           const std::vector<std::string>& fields) {
  std::vector<Bucket> buckets;
  for (size_t j = 0; j < owned.size(); ++j) {
    const int64_t mask = header[2 * j];
    if (!(mask & 1)) continue;
    for (size_t f = 0; f < fields.size(); ++f) {
      if (fields[f] == "step" || !(mask & (int64_t{2} << f))) continue;
      const auto dtype = owned[j].scalar_type();
      auto it = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) { return b.dtype == dtype; });
      if (it == buckets.end()) it = buckets.insert(buckets.end(), Bucket{dtype, {}, 0});
      it->slots.push_back({j, fields[f]});
      it->numel += owned[j].numel();
    }
  }
  return buckets;
}

constexpr int kConsolidateTag = 0x5a3d;  // + message number from one owner

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::vector<at::Tensor> params, comm::ProcessGroup pg, Factory make)
    : ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                       std::move(pg), std::move(make)) {}

ShardedOptimizer::ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, comm::ProcessGroup pg,
                                   Factory make)
    : pg_(std::move(pg)), groups_(groups.size()) {
  TORCH_CHECK(pg_.is_member(), "ShardedOptimizer: this rank is not a member of the process group");
  TORCH_CHECK(make, "ShardedOptimizer: a factory that builds the wrapped optimizer is required");
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      params_.push_back(p);
      group_of_.push_back(g);
    }
  }
  partition_ = partition_greedy(params_, pg_.size());
  group_params_.assign(groups.size(), {});
  for (size_t i = 0; i < params_.size(); ++i) group_params_[group_of_[i]].push_back(static_cast<int64_t>(i));
  // This rank's groups: the same groups and options, holding only the parameters it owns (a group
  // may be empty here; it is kept so group indices mean the same on every rank).
  std::vector<torch::optim::OptimizerParamGroup> mine;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> owned;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (group_of_[i] == g && partition_.owner[i] == pg_.rank()) owned.push_back(params_[i]);
    }
    if (groups[g].has_options()) {
      mine.emplace_back(std::move(owned), groups[g].options().clone());
    } else {
      mine.emplace_back(std::move(owned));
    }
  }
  local_ = make(std::move(mine));
  TORCH_CHECK(local_ && local_->param_groups().size() == groups.size(), "ShardedOptimizer: the factory must build an ",
              "optimizer over exactly the ", groups.size(), " param group(s) it is given");
}

void ShardedOptimizer::step() {
  local_->step();
  // Every parameter from its owner; one coalesced broadcast per owning rank, in rank order, through
  // one flat buffer (the memory planner counts one owner's parameters for it).
  at::NoGradGuard no_grad;
  at::Tensor scratch;
  if (pg_.size() > 1 && !params_.empty()) {
    scratch = at::empty({*std::max_element(partition_.elements.begin(), partition_.elements.end())},
                        params_.front().options().requires_grad(false));
  }
  for (int r = 0; r < pg_.size(); ++r) {
    std::vector<at::Tensor> owned;
    for (size_t i : partition_.by_rank[r]) owned.push_back(params_[i].detach());
    comm::broadcast_coalesced(pg_, owned, r, 64 << 20, &scratch);
  }
}

void ShardedOptimizer::zero_grad() {
  for (auto& p : params_) {
    if (p.grad().defined()) {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

torch::optim::OptimizerOptions& ShardedOptimizer::group_options(size_t g) {
  TORCH_CHECK(g < local_->param_groups().size(), "ShardedOptimizer: no param group ", g);
  return local_->param_groups()[g].options();
}

std::optional<OptimizerStateDict> ShardedOptimizer::consolidate_state_dict(int to_rank) {
  const int W = pg_.size(), me = pg_.rank();
  TORCH_CHECK(to_rank >= 0 && to_rank < W, pg_.describe(), " ShardedOptimizer::consolidate_state_dict: to_rank ",
              to_rank, " is outside the group [0, ", W, "); pass one of the group's ranks");
  // Local and deterministic, so every rank fails alike (e.g. an unsupported optimizer) before any
  // communication.
  const std::vector<at::Tensor> owned = pick(params_, partition_.by_rank[me]);
  OptimizerStateDict mine = with_rank(pg_, "consolidate_state_dict", [&] { return state_dict_of(*local_, owned); });
  const std::vector<std::string>& fields = state_fields(mine.optimizer);

  if (me != to_rank) {
    if (owned.empty()) return std::nullopt;
    std::vector<int64_t> header(2 * owned.size(), 0);
    for (size_t j = 0; j < owned.size(); ++j) {
      if (!mine.params[j]) continue;
      header[2 * j] = 1;
      for (size_t f = 0; f < fields.size(); ++f) {
        auto it = mine.params[j]->tensors.find(fields[f]);
        if (it == mine.params[j]->tensors.end()) continue;
        header[2 * j] |= int64_t{2} << f;
        if (fields[f] == "step") header[2 * j + 1] = it->second.item<int64_t>();
      }
    }
    int tag = kConsolidateTag;
    comm::send(pg_, at::tensor(header, at::kLong).to(pg_.device()), to_rank, comm::SendRecvOptions().tag(tag++));
    for (const auto& bucket : layout(header, owned, fields)) {
      std::vector<at::Tensor> parts;
      for (const auto& slot : bucket.slots) {
        const auto& t = mine.params[slot.j]->tensors.at(slot.field);
        TORCH_CHECK(t.numel() == owned[slot.j].numel() && t.scalar_type() == bucket.dtype, pg_.describe(),
                    " ShardedOptimizer::consolidate_state_dict: parameter ", partition_.by_rank[me][slot.j],
                    " field \"", slot.field, "\" has shape ", t.sizes(), " and dtype ", t.scalar_type(),
                    " unlike its parameter; the wrapped optimizer's state is not what it should be");
        parts.push_back(t.reshape({-1}));
      }
      comm::send(pg_, at::cat(parts).to(pg_.device()), to_rank, comm::SendRecvOptions().tag(tag++));
    }
    return std::nullopt;
  }

  OptimizerStateDict full;
  full.optimizer = mine.optimizer;
  full.params.resize(params_.size());
  for (size_t g = 0; g < groups_; ++g) full.groups.push_back({group_params_[g], mine.groups[g].options});
  for (size_t j = 0; j < owned.size(); ++j) full.params[partition_.by_rank[me][j]] = std::move(mine.params[j]);
  for (int r = 0; r < W; ++r) {
    if (r == me || partition_.by_rank[r].empty()) continue;
    const auto& idx = partition_.by_rank[r];
    const std::vector<at::Tensor> theirs = pick(params_, idx);
    int tag = kConsolidateTag;
    at::Tensor wire = at::empty({static_cast<int64_t>(2 * idx.size())}, at::TensorOptions(at::kLong).device(pg_.device()));
    comm::recv(pg_, wire, r, comm::SendRecvOptions().tag(tag++));
    wire = wire.cpu();
    const std::vector<int64_t> header(wire.data_ptr<int64_t>(), wire.data_ptr<int64_t>() + wire.numel());
    for (size_t j = 0; j < idx.size(); ++j) {
      if (!(header[2 * j] & 1)) continue;
      auto& entry = full.params[idx[j]].emplace();
      for (size_t f = 0; f < fields.size(); ++f) {
        if (fields[f] == "step" && (header[2 * j] & (int64_t{2} << f))) {
          entry.tensors["step"] = at::scalar_tensor(header[2 * j + 1], at::kLong);
        }
      }
    }
    for (const auto& bucket : layout(header, theirs, fields)) {
      at::Tensor flat = at::empty({bucket.numel}, at::TensorOptions(bucket.dtype).device(pg_.device()));
      comm::recv(pg_, flat, r, comm::SendRecvOptions().tag(tag++));
      int64_t offset = 0;
      for (const auto& slot : bucket.slots) {
        const auto& p = theirs[slot.j];
        full.params[idx[slot.j]]->tensors[slot.field] =
            flat.narrow(0, offset, p.numel()).view(p.sizes()).to(p.device(), /*non_blocking=*/false, /*copy=*/true);
        offset += p.numel();
      }
    }
  }
  return full;
}

void ShardedOptimizer::load_state_dict(const OptimizerStateDict& full) {
  // Checked in full against every parameter (not only the owned ones), so all ranks agree.
  with_rank(pg_, "load_state_dict", [&] { check_state_dict(full, *local_, params_); });
  for (size_t g = 0; g < groups_; ++g) {
    TORCH_CHECK(full.groups[g].params == group_params_[g], pg_.describe(), " ShardedOptimizer::load_state_dict: param ",
                "group ", g, " of the state dict holds other parameters than this optimizer's group ", g,
                "; build the ShardedOptimizer with the same param groups as the optimizer that made the dict");
  }
  // This rank's part, indexed as its local optimizer's parameters (owned ones, in order).
  const auto& idx = partition_.by_rank[pg_.rank()];
  std::vector<int64_t> local_of(params_.size(), -1);
  for (size_t j = 0; j < idx.size(); ++j) local_of[idx[j]] = static_cast<int64_t>(j);
  OptimizerStateDict mine;
  mine.optimizer = full.optimizer;
  for (size_t i : idx) mine.params.push_back(full.params[i]);
  for (size_t g = 0; g < groups_; ++g) {
    ParamGroupStateDict group{{}, full.groups[g].options};
    for (int64_t i : full.groups[g].params) {
      if (local_of[i] >= 0) group.params.push_back(local_of[i]);
    }
    mine.groups.push_back(std::move(group));
  }
  with_rank(pg_, "load_state_dict", [&] { load_state_dict_into(*local_, pick(params_, idx), mine); });
}

}  // namespace dtrain::optim
