#pragma once
// AdamW stepping all of a group's parameters with multi-tensor (foreach) operations.
//
// Design note [multi-tensor AdamW]: libtorch's torch::optim::AdamW steps one parameter at a time,
// about nine element-wise kernels each; on a GPU a 150M-parameter GPT with ~200 tensors launches
// ~1,800 small kernels per step, which PyTorch's default (foreach) AdamW does in a few dozen. This
// subclass does PyTorch's foreach arithmetic (_multi_tensor_adamw: decoupled decay, the first
// moment as one lerp, the second as mul + addcmul, one sqrt temporary) through at::_foreach_* (the
// same operations on every tensor of a group and step count); its results equal libtorch's AdamW
// to rounding (the lerp; tests/optim/adamw_test.cpp) and its state is AdamWParamState under the
// same keys (checkpoints, ZeRO and FSDP see no difference). amsgrad steps as libtorch does. The
// tensors go in runs of at most twice the largest one's elements, so the one foreach temporary
// never exceeds libtorch's two per-tensor ones: the step's peak memory stays what the memory
// planner predicts (one run over the whole model cost the demo 11% more memory than predicted
// under DDP). On one H200 (805M GPT, bf16; bench/gpu_bench.py --profile, docs/benchmarks.md) the
// first version (libtorch's mul + add, runs of one largest tensor) spent 21.1 ms per step in the
// optimizer's kernels against PyTorch's 17.2 (151M: 7.0 against 3.3, twice the launches, each
// with too few blocks to fill the GPU): what this version's lerp and doubled runs address.
#include <torch/optim/adamw.h>

namespace dtrain::optim {

class ForeachAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace dtrain::optim
