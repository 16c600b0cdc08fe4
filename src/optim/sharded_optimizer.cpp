#include "dtrain/optim/sharded_optimizer.h"

#include <c10/util/Exception.h>

#include "dtrain/comm/broadcast.h"

namespace dtrain::optim {

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
  // Every parameter from its owner; one coalesced broadcast per owning rank, in rank order.
  at::NoGradGuard no_grad;
  for (int r = 0; r < pg_.size(); ++r) {
    std::vector<at::Tensor> owned;
    for (size_t i : partition_.by_rank[r]) owned.push_back(params_[i].detach());
    comm::broadcast_coalesced(pg_, owned, r);
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

}  // namespace dtrain::optim
