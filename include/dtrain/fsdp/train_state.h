#pragma once
// FSDP's part of a training checkpoint, under the key scheme of dtrain/checkpoint/train_state.h
// (model/<name>, optim/<name>/<field>, optim/... metadata), so a run saved with FSDP at one world
// size resumes with FSDP at another, or with single/DDP/ZeRO, and the other way round.
//
// Each rank writes the ranges of every parameter its flat shards hold (no communication, no full
// gather), and the optimizer state of those ranges (the optimizer steps flat shards; each state
// tensor is cut along the same ranges; "step" is written once per parameter, by the rank holding
// its first element). Loading reads exactly the ranges this rank holds under its current layout.
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"

namespace dtrain::fsdp {

checkpoint::Snapshot snapshot_model(const FullyShardedState& fsdp);
// Checked first: every model/ key of the checkpoint is a parameter or buffer of the module, with
// the same shape and dtype, and every parameter and buffer is in the checkpoint.
void load_model(const checkpoint::Reader& reader, FullyShardedState& fsdp);

// `opt` must have been built over fsdp.trainable_shards() (e.g. wrapper->parameters()).
checkpoint::Snapshot snapshot_optimizer(const FullyShardedState& fsdp, const torch::optim::Optimizer& opt);
void load_optimizer(const checkpoint::Reader& reader, FullyShardedState& fsdp, torch::optim::Optimizer& opt);

}  // namespace dtrain::fsdp
