#pragma once
// AdamW stepping all of a group's parameters with multi-tensor (foreach) operations.
//
// Design note [multi-tensor AdamW]: libtorch's torch::optim::AdamW steps one parameter at a time,
// about nine element-wise kernels each; on a GPU a 150M-parameter GPT with ~200 tensors launches
// ~1,800 small kernels per step, which PyTorch's default (foreach) AdamW does in a few dozen. This
// subclass does libtorch's arithmetic in libtorch's order through at::_foreach_* (the same
// operations on every tensor of a group and step count), so its results equal torch::optim::AdamW
// bit for bit on the CPU (tests/optim/adamw_test.cpp) and its state is AdamWParamState under the
// same keys (checkpoints, ZeRO and FSDP see no difference). amsgrad steps as libtorch does. The
// tensors go in runs of at most the largest one's elements, so the foreach temporaries never exceed
// libtorch's per-tensor ones: the step's peak memory stays what the memory planner predicts (one
// run over the whole model cost the demo 11% more memory than predicted under DDP); a GPT's biases
// and norms still step together, its large matrices about one per run.
#include <torch/optim/adamw.h>

namespace dtrain::optim {

class ForeachAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace dtrain::optim
