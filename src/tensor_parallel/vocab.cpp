#include "dtrain/tensor_parallel/vocab.h"

#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/embedding.h>

#include "dtrain/comm/all_reduce.h"
#include "dtrain/tensor_parallel/regions.h"

namespace dtrain::tensor_parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void all_reduce(const comm::ProcessGroup& tp, at::Tensor& t, comm::ReduceOp op) {
  if (tp.size() > 1) comm::all_reduce(tp, t, comm::AllReduceOptions().op(op));
}

// Megatron's _VocabParallelCrossEntropy: the softmax over the whole vocabulary from per-rank
// maxima and sums; backward is softmax - one_hot(target) on this rank's columns.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            const comm::ProcessGroup& tp) {
    const int64_t part = logits.size(-1);
    const int64_t start = part * tp.rank();
    at::Tensor x = logits.detach().to(at::kFloat);
    at::Tensor max = std::get<0>(x.max(-1));
    all_reduce(tp, max, comm::ReduceOp::Max);
    x = x - max.unsqueeze(-1);
    // The target's logit, from the rank that holds it (0 elsewhere).
    const at::Tensor outside = (targets < start).logical_or(targets >= start + part);
    const at::Tensor local = (targets - start).masked_fill(outside, 0);
    at::Tensor target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
    all_reduce(tp, target_logit, comm::ReduceOp::Sum);
    at::Tensor exp = x.exp();
    at::Tensor sum_exp = exp.sum(-1);
    all_reduce(tp, sum_exp, comm::ReduceOp::Sum);
    at::Tensor loss = sum_exp.log() - target_logit;
    exp.div_(sum_exp.unsqueeze(-1));  // this rank's columns of the softmax
    ctx->save_for_backward({exp, local, outside});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss.to(logits.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();
    const at::Tensor& local = saved[1];
    const at::Tensor inside = saved[2].logical_not().to(grad.scalar_type());
    grad.scatter_add_(-1, local.unsqueeze(-1), -inside.unsqueeze(-1));
    grad.mul_(g[0].to(grad.scalar_type()).unsqueeze(-1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t n, int64_t d, comm::ProcessGroup tp)
    : num_embeddings(n), dim(d), tp_(std::move(tp)) {
  if (n % tp_.size() != 0) {
    throw std::invalid_argument("VocabParallelEmbedding: the vocabulary (" + std::to_string(n) +
                                ") does not divide by the tensor-parallel degree " + std::to_string(tp_.size()) +
                                " (rank " + std::to_string(tp_.rank()) + "); pick a --tp that divides it");
  }
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  torch::nn::Embedding full(num_embeddings, dim);
  weight = register_parameter("weight", slice_along(full->weight.detach(), tp_, 0));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& tokens) {
  const int64_t part = weight.size(0);
  const int64_t start = part * tp_.rank();
  const at::Tensor outside = (tokens < start).logical_or(tokens >= start + part);
  at::Tensor out = at::embedding(weight, (tokens - start).masked_fill(outside, 0));
  out = out.masked_fill(outside.unsqueeze(-1), 0.0);
  return reduce_from_region(out, tp_);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                        const comm::ProcessGroup& tp) {
  return VocabParallelCrossEntropy::apply(logits, targets, tp);
}

}  // namespace dtrain::tensor_parallel
