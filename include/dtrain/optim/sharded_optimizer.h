#pragma once
// ZeRO-1: optimizer state sharded across ranks (FairScale's OSS, PyTorch's
// ZeroRedundancyOptimizer) for any torch::optim optimizer.
//
//   auto opt = dtrain::optim::ShardedOptimizer(model->parameters(), pg,
//       [](std::vector<torch::optim::OptimizerParamGroup> groups) {
//         return std::make_unique<torch::optim::AdamW>(std::move(groups), torch::optim::AdamWOptions(1e-3));
//       });
//   ... backward (gradients averaged, e.g. by DDP) ...; opt.step();
//
// Each rank builds the wrapped optimizer over the parameters it owns (partition_greedy), with the
// same param groups and options, so its state is about 1/W of the plain optimizer's. step() steps
// the owned parameters, then every parameter is broadcast from its owner, so all ranks end with
// the same parameters as the plain optimizer would give.
//
// State: consolidate_state_dict() gathers every parameter's state from its owner onto one rank, as
// the plain optimizer over params() would hold it (state_dict.h); load_state_dict() takes such a
// dict (from any world size, or from a plain optimizer's state_dict_of) and keeps what this rank
// owns under its own partition. See docs/zero.md.
//
// With it: sharded gradients (ZeRO-2) are ddp::ShardedDataParallel, global-norm clipping over the
// shards is optim::clip_grad_norm (clip_grad.h); train::parallelize composes them by
// --strategy zero1|zero2, and its Strategy::optimizer() gives this rank's local optimizer (a
// torch::optim::Optimizer: learning-rate schedules set its param groups' lr).
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <torch/optim/optimizer.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/optim/partition.h"
#include "dtrain/optim/state_dict.h"

namespace dtrain::optim {

class ShardedOptimizer {
 public:
  using Factory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

  ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, comm::ProcessGroup pg, Factory make);
  ShardedOptimizer(std::vector<at::Tensor> params, comm::ProcessGroup pg, Factory make);

  void step();
  void zero_grad();

  // Param group g's options on this rank's optimizer (e.g. to change the learning rate: every
  // rank must make the same change, as with the plain optimizer under DDP).
  torch::optim::OptimizerOptions& group_options(size_t g);
  size_t num_groups() const { return groups_; }

  // Collective: every rank calls it. Rank `to_rank` gets the full state dict (every parameter's
  // state, sent by its owner over the process group; group options from `to_rank`'s optimizer),
  // indexed as params(); the other ranks get nullopt. Equal to state_dict_of(plain optimizer,
  // params()) after the same steps. Memory: the full state on `to_rank` only.
  std::optional<OptimizerStateDict> consolidate_state_dict(int to_rank = 0);

  // Every rank passes the same full dict (indexed as params(); from consolidate_state_dict at any
  // world size, or state_dict_of a plain optimizer); each keeps the state of the parameters it
  // owns and sets every group's options. Checked in full on every rank before anything changes,
  // so a bad dict fails on all ranks alike. No communication.
  void load_state_dict(const OptimizerStateDict& full);

  torch::optim::Optimizer& local() { return *local_; }
  const ParamPartition& partition() const { return partition_; }
  const comm::ProcessGroup& process_group() const { return pg_; }
  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  comm::ProcessGroup pg_;
  std::vector<at::Tensor> params_;  // every parameter of every group, in order
  std::vector<size_t> group_of_;    // per parameter: its group
  size_t groups_ = 0;
  ParamPartition partition_;
  std::vector<std::vector<int64_t>> group_params_;  // per group: its parameters' indices into params_
  std::unique_ptr<torch::optim::Optimizer> local_;
};

}  // namespace dtrain::optim
