#include "dtrain/tensor_parallel/block.h"

#include <cmath>
#include <limits>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/tensor_parallel/dropout.h"
#include "dtrain/tensor_parallel/regions.h"

namespace dtrain::tensor_parallel {

namespace {
constexpr double kLayerNormEps = 1e-5;  // models::GPTBlock's
}

ParallelBlockImpl::ParallelBlockImpl(const models::GPTOptions& options, comm::ProcessGroup tp, bool sequence_parallel)
    : options_(options), tp_(std::move(tp)), sequence_parallel_(sequence_parallel) {
  const int64_t n = tp_.size();
  if (options_.heads() % n != 0) {
    throw std::invalid_argument("tensor parallel: " + std::to_string(options_.heads()) +
                                " attention heads do not divide by the tensor-parallel degree " + std::to_string(n) +
                                "; pick a --tp that divides --heads");
  }
  if ((options_.mlp_ratio() * options_.d_model()) % n != 0) {
    throw std::invalid_argument("tensor parallel: the MLP width " + std::to_string(options_.mlp_ratio() * options_.d_model()) +
                                " does not divide by the tensor-parallel degree " + std::to_string(n));
  }
  reset();
}

void ParallelBlockImpl::reset() {
  const int64_t c = options_.d_model();
  const int64_t hidden = options_.mlp_ratio() * c;
  auto ln = [&] { return torch::nn::LayerNormOptions({c}).eps(kLayerNormEps); };
  auto col = [&](int64_t in, int64_t out) {
    return ParallelLinearOptions(in, out).sequence_parallel(sequence_parallel_);
  };
  ln1 = register_module("ln1", torch::nn::LayerNorm(ln()));
  qkv = register_module("qkv", ColumnParallelLinear(col(c, 3 * c).stride(3), tp_));
  attn_proj = register_module("attn_proj", RowParallelLinear(col(c, c), tp_));
  ln2 = register_module("ln2", torch::nn::LayerNorm(ln()));
  fc = register_module("fc", ColumnParallelLinear(col(c, hidden), tp_));
  mlp_proj = register_module("mlp_proj", RowParallelLinear(col(hidden, c), tp_));
}

at::Tensor ParallelBlockImpl::layer_norm(const at::Tensor& x, const torch::nn::LayerNorm& ln) const {
  const int64_t c = options_.d_model();
  if (!sequence_parallel_) return at::layer_norm(x, {c}, ln->weight, ln->bias, kLayerNormEps);
  // Each rank normalises its part of the sequence: the parameters' gradients are partial sums.
  return at::layer_norm(x, {c}, copy_to_region(ln->weight, tp_), copy_to_region(ln->bias, tp_), kLayerNormEps);
}

at::Tensor ParallelBlockImpl::forward(const at::Tensor& x) {
  return forward_hooks().run({x}, [this](const nn::Tensors& in) { return nn::Tensors{body(in[0])}; })[0];
}

at::Tensor ParallelBlockImpl::body(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == options_.d_model(), "ParallelBlock: expected input [B, T, d_model = ",
              options_.d_model(), "], got ", x.sizes());
  const int64_t n = tp_.size();
  const int64_t b = x.size(0), c = x.size(2);
  const int64_t t = sequence_parallel_ ? x.size(1) * n : x.size(1);
  const int64_t h = options_.heads() / n, d = c / options_.heads();

  // --- causal self-attention over this rank's heads ---
  at::Tensor a = qkv(layer_norm(x, ln1));  // [B, T, 3C/n]: q | k | v of this rank's heads
  auto heads = a.view({b, t, 3, h, d}).permute({2, 0, 3, 1, 4}).contiguous().unbind(0);
  const at::Tensor q = heads[0].view({b * h, t, d});
  const at::Tensor k = heads[1].view({b * h, t, d});
  const at::Tensor v = heads[2].view({b * h, t, d});
  const at::Tensor mask = at::full({t, t}, -std::numeric_limits<double>::infinity(), q.options()).triu_(1);
  at::Tensor att = at::baddbmm(mask, q, k.transpose(1, 2), 1.0, 1.0 / std::sqrt(static_cast<double>(d)));
  // Dropout (Design note [dropout streams], dropout.h): this rank's heads' masks inside the
  // region, the whole activation's outside it (this rank's part of the sequence under SP).
  const double p = options_.dropout();
  const bool training = is_training();
  const int64_t seq_dim = sequence_parallel_ ? 1 : -1;
  at::Tensor probs = dropout_heads(at::softmax(att, -1).view({b, h, t, t}), p, training, tp_.rank() * h);
  at::Tensor y = at::bmm(probs.view({b * h, t, t}), v);             // [B*h, T, D]
  y = y.view({b, h, t, d}).transpose(1, 2).reshape({b, t, h * d});  // [B, T, C/n]
  at::Tensor x2 = x + dropout_replicated(attn_proj(y), p, training, tp_, seq_dim);

  // --- MLP over this rank's hidden features ---
  at::Tensor m = mlp_proj(at::gelu(fc(layer_norm(x2, ln2))));
  return x2 + dropout_replicated(m, p, training, tp_, seq_dim);
}

}  // namespace dtrain::tensor_parallel
