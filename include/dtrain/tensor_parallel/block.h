#pragma once
// models::GPTBlock with its matrices split over a tensor-parallel group (Megatron-LM's transformer
// layer): attention heads divided among the ranks, the MLP's hidden features too; one all-reduce
// per sub-layer forward and one backward (or, with sequence parallelism, an all-gather entering
// and a reduce-scatter leaving each sub-layer, the activations between them split along the
// sequence).
//
//   x ─ ln1 ─ qkv (column, stride 3: this rank's heads of q, k and v) ─ attention over those heads
//     ─ attn_proj (row) ─ + x ─ ln2 ─ fc (column) ─ gelu ─ mlp_proj (row) ─ + ─>
//
// Parameter names are GPTBlock's (ln1.weight, qkv.weight, ...); each rank holds its piece of each
// (tensor_parallel::Plan says how each is cut; load_pieces takes a plain block's values), so a TP
// model's state maps onto the plain model's names and full shapes. LayerNorms are whole on every rank; under sequence parallelism each rank normalises its
// part of the sequence and their gradients are summed over the group.
// Dropout (options.dropout()) on the attention probabilities and both residual branches, as
// GPTBlock's, with masks that do not depend on the degree (Design note [dropout streams],
// dropout.h).
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/models/gpt.h"
#include "dtrain/nn/forward_hooks.h"
#include "dtrain/tensor_parallel/linear.h"

namespace dtrain::tensor_parallel {

// Its forward runs through forward hooks (dtrain/nn/forward_hooks.h), as GPTBlock's: FSDP units and
// activation checkpointing wrap it in place (recomputation replays its collectives in backward, on
// every rank of the group alike).
class ParallelBlockImpl : public torch::nn::Cloneable<ParallelBlockImpl>, public nn::Hookable {
 public:
  // Throws std::invalid_argument (naming the sizes) unless heads and the MLP width divide by
  // tp.size().
  ParallelBlockImpl(const models::GPTOptions& options, comm::ProcessGroup tp, bool sequence_parallel = false);
  void reset() override;
  // x: [B, T, d_model] (sequence parallel: [B, T / tp, d_model], this rank's part of the sequence,
  // in rank order) -> the same shape.
  at::Tensor forward(const at::Tensor& x);

  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ColumnParallelLinear qkv{nullptr}, fc{nullptr};
  RowParallelLinear attn_proj{nullptr}, mlp_proj{nullptr};

 private:
  at::Tensor body(const at::Tensor& x);
  at::Tensor layer_norm(const at::Tensor& x, const torch::nn::LayerNorm& ln) const;
  models::GPTOptions options_;
  comm::ProcessGroup tp_;
  bool sequence_parallel_;
};
TORCH_MODULE(ParallelBlock);

}  // namespace dtrain::tensor_parallel
