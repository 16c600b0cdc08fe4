#pragma once
// FSDP's part of a training checkpoint, under the key scheme of dtrain/checkpoint/train_state.h
// (model/<name>, optim/<name>/<field>, optim/... metadata), so a run saved with FSDP at one world
// size resumes with FSDP at another, or with single/DDP/ZeRO, and the other way round.
//
// Each rank writes the ranges of every parameter its flat shards hold (no communication, no full
// gather), and the optimizer state of those ranges (the optimizer steps flat shards; each state
// tensor is cut along the same ranges; "step" is written once per parameter, by the rank holding
// its first element). Loading reads exactly the ranges this rank holds under its current layout.
#include <vector>

#include "dtrain/checkpoint/train_state.h"
#include "dtrain/fsdp/flat_param.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"

namespace dtrain::fsdp {

// What a rank holds of a set of FlatParams, for their checkpoints: the master shards (trainable
// and frozen, the order ShardSlice::flat indexes) and the ranges of every parameter they hold.
// `writes`: this rank writes them (the first replica; replicas hold equal shards).
struct ShardView {
  std::vector<at::Tensor> shards;
  std::vector<ShardSlice> slices;
  bool writes = true;
};
// The view of any FlatParams (e.g. pipeline stages sharded over their data-parallel group).
ShardView shard_view(const std::vector<const FlatParam*>& flats, bool writes);
ShardView shard_view(const FullyShardedState& fsdp);

// Parameters only (buffers are the caller's): this rank's ranges as pieces, and loading them back.
std::vector<checkpoint::Piece> snapshot_params(const ShardView& view, const std::string& prefix = "model/");
void load_params(const checkpoint::Reader& reader, const ShardView& view);
// The optimizer over view's trainable shards (in order).
checkpoint::Snapshot snapshot_optimizer(const ShardView& view, const torch::optim::Optimizer& opt);
void load_optimizer(const checkpoint::Reader& reader, const ShardView& view, torch::optim::Optimizer& opt);

checkpoint::Snapshot snapshot_model(const FullyShardedState& fsdp);
// Checked first: every model/ key of the checkpoint is a parameter or buffer of the module, with
// the same shape and dtype, and every parameter and buffer is in the checkpoint.
void load_model(const checkpoint::Reader& reader, FullyShardedState& fsdp);

// `opt` must have been built over fsdp.trainable_shards() (e.g. wrapper->parameters()).
checkpoint::Snapshot snapshot_optimizer(const FullyShardedState& fsdp, const torch::optim::Optimizer& opt);
void load_optimizer(const checkpoint::Reader& reader, FullyShardedState& fsdp, torch::optim::Optimizer& opt);

}  // namespace dtrain::fsdp
