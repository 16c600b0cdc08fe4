#pragma once
// FSDP around pipeline stages: the parameters of the stages one rank runs, sharded over the
// stage's data-parallel group (one FlatParam per stage, fsdp/flat_param.h), gathered for a whole
// pipeline step, their gradients reduce-scattered once per optimizer step.
//
//   pipeline::ShardedStages sharded(pipe.stages(), groups);     // groups: parallel::Layout{1, D, P}
//   torch::optim::AdamW opt(sharded.trainable_shards(), ...);   // steps 1/D of each stage
//   for (...) {
//     opt.zero_grad();
//     sharded.gather();                 // (or from the stages' forwards: gather() is idempotent)
//     pipe.step(x, y);
//     sharded.reduce_gradients();       // average over the data-parallel group into the shards
//     opt.step();
//     sharded.reshard();
//   }
//
// Design note [sharded stages]
// ----------------------------
// A pipeline runs each stage m times forward and m times backward per step, interleaved with the
// other micro-batches (1F1B) or not (GPipe). FSDP's per-unit gather/free (fsdp/iteration.cpp)
// would all-gather a stage 2m times and reduce-scatter it m times per step; instead, as PyTorch's
// pipelining does with FSDP2 (reshard_after_forward off, gradient sync on the last micro-batch
// only) and torchtitan by default with PP, a stage's parameters are gathered at its first forward
// of the step and stay gathered until the optimizer has stepped, and its gradients accumulate in
// full over the micro-batches and leave through one reduce-scatter. A rank thus holds, between
// steps, 1/D of its stages' parameters, gradients and optimizer state (ZeRO-3); during a step its
// stages' full parameters and gradients as well (ZeRO-2's peak). The same argument is why ZeRO-2
// is not offered around stages: it would reduce every micro-batch's gradients (DeepSpeed's
// pipeline engine allows ZeRO-1 only).
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/fsdp/flat_param.h"
#include "dtrain/fsdp/train_state.h"
#include "dtrain/parallel/layout.h"
#include "dtrain/pipeline/stage.h"

namespace dtrain::pipeline {

class ShardedStages {
 public:
  enum class State {
    Sharded,   // each stage's parameters are empty placeholders; only the shards exist
    Gathered,  // the stages' parameters are views of their gathered full buffers
    Reduced,   // gradients reduce-scattered into the shards' .grad; parameters still gathered
  };

  // `stages`: the ones this rank runs (their parameters: fp32 or any one dtype per stage, all
  // trainable; throws std::invalid_argument naming the stage otherwise). Their current values
  // become the shards: they must be equal on the data-parallel ranks (broadcast them first).
  // `groups` must outlive this (the FlatParams keep a pointer to it).
  ShardedStages(const std::vector<Stage>& stages, const parallel::Groups& groups);
  ShardedStages(const ShardedStages&) = delete;
  ShardedStages& operator=(const ShardedStages&) = delete;

  // Sharded -> Gathered (every stage's all-gather in flight together); a no-op when gathered.
  void gather();
  // Gathered -> Reduced: every stage's full gradients (zeros where a parameter has none) averaged
  // over the data-parallel group; the full gradients are dropped.
  void reduce_gradients();
  // -> Sharded (frees the full buffers; unreduced gradients are dropped).
  void reshard();
  // Every stage's parameters back as zeros of their full shapes, without their gradients (the
  // model put under a plan again, its values from the next load: an elastic regroup); not
  // collective. The shards stay as they were.
  void release();
  State state() const { return state_; }

  // What the optimizer steps: one flat shard per stage (padding zeros).
  std::vector<at::Tensor> trainable_shards() const;
  // This rank's ranges of every parameter, for checkpoints (fsdp/train_state.h).
  fsdp::ShardView view() const;
  // Writes each parameter's current full value (e.g. loaded into the gathered parameters) into
  // the shards. Gathered only.
  void store_gathered_values();
  const std::vector<std::unique_ptr<fsdp::FlatParam>>& flats() const { return flats_; }

 private:
  const parallel::Groups& groups_;
  std::vector<std::unique_ptr<fsdp::FlatParam>> flats_;
  State state_ = State::Sharded;
};

}  // namespace dtrain::pipeline
