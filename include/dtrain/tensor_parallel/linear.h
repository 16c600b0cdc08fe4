#pragma once
// Tensor-parallel linear layers (Megatron-LM's ColumnParallelLinear / RowParallelLinear; PyTorch's
// ColwiseParallel / RowwiseParallel): ordinary libtorch modules a model is built from.
//
//   auto up = tensor_parallel::ColumnParallelLinear(
//       tensor_parallel::ParallelLinearOptions(d, 4 * d), tp);       // weight [4d/n, d]
//   auto down = tensor_parallel::RowParallelLinear(
//       tensor_parallel::ParallelLinearOptions(4 * d, d), tp);       // weight [d, 4d/n]
//   y = down(at::gelu(up(x)));   // one all-reduce forward (in down), one backward (in up)
//
// A column-parallel layer keeps rows [r out/n, (r+1) out/n) of the weight and of the bias: its
// input enters the region through copy_to_region (identity forward, all-reduce of the input's
// gradient backward) and its output is this rank's slice of the features (gather_output: all of
// them). A row-parallel layer keeps columns [r in/n, (r+1) in/n) of the weight and the whole bias:
// it takes this rank's slice of the input features (input_is_parallel, else it slices), and its
// partial products are summed by reduce_from_region before the bias is added once.
// With sequence_parallel the activations outside the region are split along `sequence_dim` over
// the group: the column layer all-gathers them on entry (reduce-scatter of the gradient), the row
// layer reduce-scatters its output (all-gather of the gradient) instead of all-reducing, and its
// bias's gradient (from this rank's part of the sequence) is summed over the group.
//
// Initialisation: each layer draws the full weight and bias exactly as torch::nn::Linear(in, out)
// does (same generator, same order) and keeps its slice, so a model built from these layers with a
// seed holds the pieces of the plain model built with that seed (every rank of the group must seed
// alike). Parameters are named "weight" and "bias", as Linear's; shard_dim() says how each is cut
// (tensor_parallel::Plan cuts and joins full values for checkpoints).
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::tensor_parallel {

struct ParallelLinearOptions {
  ParallelLinearOptions(int64_t in_features, int64_t out_features) : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  // Column: return every rank's output features (all-gather) instead of this rank's slice.
  TORCH_ARG(bool, gather_output) = false;
  // Row: the input is already this rank's slice of the features (a column layer's output).
  TORCH_ARG(bool, input_is_parallel) = true;
  // Column: the output features are `stride` blocks cut alike (a fused q | k | v projection has
  // 3: rank r keeps rows r of each block, so its output is its q | k | v), as Megatron's stride.
  TORCH_ARG(int64_t, stride) = 1;
  // Activations outside the region split along sequence_dim over the group (see above).
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(int64_t, sequence_dim) = 1;  // [batch, sequence, features]
};

class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl> {
 public:
  // Throws std::invalid_argument (naming the sizes) unless out_features divides by stride x tp.size().
  ColumnParallelLinearImpl(ParallelLinearOptions options, comm::ProcessGroup tp);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  // The dimension of the full tensor a parameter is cut along (-1: whole on every rank).
  int64_t shard_dim(const std::string& param) const { return param == "weight" || param == "bias" ? 0 : -1; }
  const comm::ProcessGroup& group() const { return tp_; }
  ParallelLinearOptions options;
  at::Tensor weight, bias;

 private:
  comm::ProcessGroup tp_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl> {
 public:
  // Throws std::invalid_argument (naming the sizes) unless in_features divides by tp.size().
  RowParallelLinearImpl(ParallelLinearOptions options, comm::ProcessGroup tp);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  int64_t shard_dim(const std::string& param) const { return param == "weight" ? 1 : -1; }
  const comm::ProcessGroup& group() const { return tp_; }
  ParallelLinearOptions options;
  at::Tensor weight, bias;

 private:
  comm::ProcessGroup tp_;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace dtrain::tensor_parallel
