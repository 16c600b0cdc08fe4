#pragma once
// How dtrain-gpt trains, picked by --strategy: the model wrapper, the optimizer, gradient clipping
// and gradient accumulation, composed in one place (see make_strategy).
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/models/gpt.h"
#include "options.h"

namespace gpt_demo {

class Strategy {
 public:
  virtual ~Strategy() = default;
  // Mean loss of one micro-batch (forward through whatever wraps the model).
  virtual at::Tensor loss(const at::Tensor& x, const at::Tensor& y) = 0;
  // While the returned guard lives, backward communicates nothing (gradient accumulation).
  virtual std::shared_ptr<void> no_sync() = 0;
  virtual void zero_grad() = 0;
  // Clips the gradients to a global norm (over all ranks' shards) and returns that norm.
  virtual double clip_grad_norm(double max_norm) = 0;
  virtual void step() = 0;
  // The parameters whose .grad this rank holds after backward and its optimizer steps: every
  // parameter for single/ddp, the owned ones for zero1/zero2, the flat shards for fsdp/hsdp. What
  // the loss scaler unscales and checks for inf/NaN (its sharded form, loss_scaling.h).
  virtual std::vector<at::Tensor> grads_held() = 0;
  // Bytes of optimizer state held by this rank.
  virtual int64_t optimizer_state_bytes() = 0;
  // Checkpoints (checkpointing.h): this rank's part of the model and optimizer state, under the
  // keys of dtrain/checkpoint/train_state.h (the same for every strategy, so a checkpoint resumes
  // under another strategy or world size), and loading it back. No communication.
  virtual dtrain::checkpoint::Snapshot state_snapshot() {
    throw std::invalid_argument("this --strategy cannot save checkpoints yet (Strategy::state_snapshot)");
  }
  virtual void load_state(const dtrain::checkpoint::Reader& reader) {
    throw std::invalid_argument("this --strategy cannot resume from checkpoints yet (Strategy::load_state)");
  }
  // --export-weights: the trained weights as one plain safetensors file at `path`, for inference:
  // each parameter once, under its name in the unwrapped model (tied aliases left out), then the
  // buffers; written by rank 0 of `pg`. Returns the path on rank 0, "" elsewhere. The default
  // writes rank 0's (replicated) model; collective for strategies that shard parameters.
  virtual std::string export_weights(const std::string& path, const dtrain::comm::ProcessGroup& pg);
  // Sum and sum of squares of every parameter, in double (identical on every rank). Collective
  // for strategies that shard parameters.
  virtual std::pair<double, double> param_sums();
  // Peak bytes of parameters and gradients this rank owned (sharded strategies; -1: not tracked).
  virtual int64_t peak_owned_bytes() { return -1; }
  const dtrain::models::GPT& model() const { return model_; }

 protected:
  explicit Strategy(dtrain::models::GPT model) : model_(std::move(model)) {}
  dtrain::models::GPT model_;
};

// single | ddp | zero1 | zero2 | fsdp | hsdp; throws std::invalid_argument for a bad combination.
std::unique_ptr<Strategy> make_strategy(const Options& o, const dtrain::comm::ProcessGroup& pg,
                                        dtrain::models::GPT model);

}  // namespace gpt_demo
