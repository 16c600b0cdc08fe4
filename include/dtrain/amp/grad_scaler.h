#pragma once
// Dynamic loss scaling, as torch.cuda.amp.GradScaler (and FairScale's ShardedGradScaler when given
// a process group): scale the loss, unscale the gradients before clipping/stepping, skip the step
// when any gradient is inf/NaN, and grow or back off the scale.
//
//   amp::GradScaler scaler(amp::GradScalerOptions(), pg);   // pg: every rank agrees on inf/NaN
//   scaler.scale(loss).backward();
//   scaler.unscale(params);                // the gradients this rank holds (its shards)
//   clip...;                               // optional, on true gradients
//   scaler.step([&] { optimizer.step(); }); // skipped on every rank if any rank saw inf/NaN
//   scaler.update();
//
// Sharded gradients: pass the tensors this rank holds (ZeRO-2's owned gradients, FSDP's shards:
// wrapper->parameters()); the agreed inf/NaN check makes every rank skip together. Its state goes
// into training checkpoints with checkpoint::put_grad_scaler_state (train_state.h).
//
// Devices: the gradients may live on any device (several, e.g. FSDP's cpu_offload shards on the
// CPU with an NCCL group); the inf/NaN check stays on their device with one host read per step,
// and the agreement runs on the group's device (Design note [device-side inf check]). fp16 needs
// CUDA and has not run here (no GPU has been lent); the same code runs on the CPU in the tests
// and in dtrain-gpt --loss-scale dynamic (fp32/bf16), where the scale is numerically irrelevant.
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::amp {

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;  // steps without inf/NaN before the scale grows
  TORCH_ARG(bool, enabled) = true;             // false: every call is a pass-through
};

// The scaler's training state (saved and restored with the rest of a run).
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {}, std::optional<comm::ProcessGroup> pg = std::nullopt);

  at::Tensor scale(const at::Tensor& loss) const;
  // Divides the gradients of `params` by the scale (once per step) and records whether any is
  // inf/NaN; with a process group the finding is agreed across ranks (all-reduce max), so every
  // rank skips or steps together.
  void unscale(const std::vector<at::Tensor>& params);
  // Unscales first if unscale() was not called this step; runs `optimizer_step` unless a
  // gradient was inf/NaN. Returns whether it stepped.
  bool step(const std::function<void()>& optimizer_step, const std::vector<at::Tensor>& params);
  // Backs off after a skipped step, grows after growth_interval good ones; starts a new step.
  void update();

  double get_scale() const { return state_.scale; }
  GradScalerState state() const { return state_; }
  void load_state(const GradScalerState& s);
  bool found_inf() const { return found_inf_; }
  // An elastic regroup (train/elastic.h): the agreement on inf/NaN goes over the new group from
  // now on, and the step the failure cut is forgotten (its unscale or skip decision is redone).
  void regroup(std::optional<comm::ProcessGroup> pg) {
    pg_ = std::move(pg);
    stage_ = Stage::Ready;
    found_inf_ = false;
  }

 private:
  enum class Stage {
    Ready,     // nothing done for this step yet
    Unscaled,  // gradients divided by the scale; found_inf_ is agreed across ranks
    Stepped,   // step() ran (or was skipped); update() comes next
  };
  GradScalerOptions options_;
  std::optional<comm::ProcessGroup> pg_;
  GradScalerState state_;
  Stage stage_ = Stage::Ready;
  bool found_inf_ = false;
};

}  // namespace dtrain::amp
