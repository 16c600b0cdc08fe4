#pragma once
// models::GPT built from tensor-parallel layers (dtrain/tensor_parallel/): the same parameter names
// and, piece by piece, the same values and gradients as the plain GPT, with the vocabulary, the
// attention heads and the MLP split over a tensor-parallel group (Megatron-LM's GPT).
//
//   tokens ─ tok_emb (vocabulary-parallel) + pos_emb ─ [sequence parallel: this rank's part of T]
//     ─ ParallelBlock x layers ─ ln_f ─ lm_head (column-parallel: this rank's V / n logits)
//   loss: tensor_parallel::vocab_parallel_cross_entropy (the logits are never gathered)
//
// Every rank of the group gets the same tokens. Build it from a plain GPT's values (load_from: each
// rank keeps its pieces; tensor_parallel::Plan::of(model, tp) says how each parameter is cut).
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/process_group.h"
#include "dtrain/models/gpt.h"
#include "dtrain/tensor_parallel/block.h"
#include "dtrain/tensor_parallel/linear.h"
#include "dtrain/tensor_parallel/vocab.h"

namespace dtrain::models {

class ParallelGPTImpl : public torch::nn::Cloneable<ParallelGPTImpl> {
 public:
  // Throws std::invalid_argument (naming the sizes) unless the vocabulary, the heads and the MLP
  // width divide by tp.size(). Dropout masks do not depend on tp.size() (Design note [dropout
  // streams], tensor_parallel/dropout.h). The layers' init draws from the default CPU generator,
  // whose state the constructor then restores (as GPT, which has its own generator, leaves it).
  ParallelGPTImpl(const GPTOptions& options, comm::ProcessGroup tp, bool sequence_parallel = false);
  void reset() override;
  // tokens int64 [B, T] (T divisible by the group's size with sequence parallelism) -> this rank's
  // logits [B, T, vocab_size / tp].
  at::Tensor forward(const at::Tensor& tokens);
  // forward in parts (pipeline stages, gpt_stages): the embeddings [B, T, C] (sequence parallel:
  // this rank's part [B, T / tp, C]), then the blocks, then head: the final LayerNorm and this
  // rank's logits.
  // (training: whether the embeddings' dropout is on; a pipeline stage passes its own mode.)
  at::Tensor embed(const at::Tensor& tokens, bool training);
  at::Tensor head(const at::Tensor& x);
  // The mean next-token cross-entropy of forward()'s logits (the same on every rank).
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;
  // Copies every parameter's piece from a plain GPT of the same options.
  void load_from(const GPTImpl& full);
  const comm::ProcessGroup& group() const { return tp_; }
  const GPTOptions& options() const { return options_; }

  tensor_parallel::VocabParallelEmbedding tok_emb{nullptr};
  torch::nn::Embedding pos_emb{nullptr};
  torch::nn::ModuleList block_list{nullptr};  // registered as "blocks"
  torch::nn::LayerNorm ln_f{nullptr};
  tensor_parallel::ColumnParallelLinear lm_head{nullptr};

 private:
  GPTOptions options_;
  comm::ProcessGroup tp_;
  bool sequence_parallel_;
};
TORCH_MODULE(ParallelGPT);

}  // namespace dtrain::models
