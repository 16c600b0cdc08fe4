#pragma once
// The vocabulary split over the tensor-parallel group (Megatron-LM's VocabParallelEmbedding and
// vocab_parallel_cross_entropy; PyTorch's loss_parallel): rank r holds rows [r V/n, (r+1) V/n) of
// the embedding table, and of the output layer (a ColumnParallelLinear, tensor_parallel/linear.h,
// without gather_output), whose logits' cross-entropy is computed without ever gathering them.
//
//   auto emb = tensor_parallel::VocabParallelEmbedding(V, C, tp);   // weight [V/n, C]
//   auto head = tensor_parallel::ColumnParallelLinear(ParallelLinearOptions(C, V).bias(false), tp);
//   at::Tensor logits = head(h);                                      // [B, T, V/n] on each rank
//   at::Tensor loss = tensor_parallel::vocab_parallel_cross_entropy(logits, targets, tp).mean();
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::tensor_parallel {

class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl> {
 public:
  // Draws the full table as torch::nn::Embedding(num_embeddings, dim) does and keeps this rank's
  // rows. Throws std::invalid_argument (naming the sizes) unless num_embeddings divides by tp.size().
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t dim, comm::ProcessGroup tp);
  void reset() override;
  // tokens: int64, any shape, values in [0, num_embeddings) -> [..., dim] (the same on every rank:
  // each rank looks up the tokens in its rows, zeros elsewhere, and the group sums).
  at::Tensor forward(const at::Tensor& tokens);
  int64_t shard_dim(const std::string& param) const { return param == "weight" ? 0 : -1; }
  int64_t num_embeddings, dim;
  at::Tensor weight;

 private:
  comm::ProcessGroup tp_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Cross-entropy of each position: logits [..., V/n] (this rank's part of the vocabulary, rank
// order), targets int64 [...] in [0, V). Returns the loss per position [...], the same on every
// rank, as at::cross_entropy(full logits, targets, reduction none) would. Three all-reduces of
// [...]-sized tensors (max, target logit, sum of exponentials); the logits' gradient stays local.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, const comm::ProcessGroup& tp);

}  // namespace dtrain::tensor_parallel
