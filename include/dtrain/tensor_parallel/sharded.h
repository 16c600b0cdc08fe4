#pragma once
// A tensor-parallel model under FSDP or HSDP over its data-parallel group (TP inside FSDP, as
// torchtitan's 2-D parallelism): FSDP flattens and shards each rank's pieces as it would plain
// parameters; these functions put its shards back in the full tensors' coordinates, so the
// checkpoints name and shape every tensor as the plain model does and move to any layout.
//
// Design note [TP inside FSDP]
// ----------------------------
// A rank's FlatParam holds ranges of its pieces; a range of a piece is a few contiguous runs of
// the full tensor (Plan::segments: one per stride block of a row cut, one per row of a column
// cut). full_view rewrites FSDP's ShardView in those coordinates, and every FSDP checkpoint
// function (snapshot_params, load_params, snapshot_optimizer, load_optimizer) then works
// unchanged: no gather, each rank writes what it holds. A parameter whole on every tensor rank
// is written by tensor rank 0 only; each element of the model is written once. The data-parallel
// group (the ranks of one tensor rank) is FSDP's world: its initial broadcast and its gathers stay
// within one tensor rank's pieces.
#include <string>
#include <vector>

#include "dtrain/checkpoint/store.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/fsdp/train_state.h"
#include "dtrain/tensor_parallel/plan.h"

namespace dtrain::tensor_parallel {

// `local` (FSDP's view of this rank's pieces) in full-tensor coordinates: each slice split into
// the runs it covers, shapes full. writing: drop the slices of whole parameters on tensor ranks
// other than 0 (for saving and for norms: every element once); loading keeps them all.
fsdp::ShardView full_view(const fsdp::ShardView& local, const Plan& plan, bool writing);

// Checks every model/ key of the checkpoint against the model's full names and shapes (as
// fsdp::load_model does for a plain model), then loads this rank's shard ranges of its pieces and
// the buffers (whole).
void load_model(const checkpoint::Reader& reader, fsdp::FullyShardedState& fsdp, const Plan& plan);

}  // namespace dtrain::tensor_parallel
