#pragma once
// A byte-level, decoder-only GPT-2-style transformer (the model of the GPT demo and benchmark).
//
//   tokens [B, T] int64 -> tok_emb + pos_emb -> GPTBlock x layers -> ln_f -> lm_head
//   -> logits [B, T, vocab_size]
//
// GPTBlock (pre-LayerNorm): x = x + attn_proj(causal_self_attention(qkv(ln1(x))))
//                           x = x + mlp_proj(gelu(fc(ln2(x))))
// - attention: fused qkv Linear (d_model -> 3 d_model, columns q | k | v, heads split as
//   [heads, head_dim] inside each), softmax(q k^T / sqrt(head_dim) + causal mask) v, computed by
//   scaled_dot_product_attention where libtorch has it (GPTOptions::fused_attention).
// - GELU is the exact (erf) form, PyTorch's nn.GELU() default (GPT-2 used the tanh approximation).
// - LayerNorm eps = 1e-5. Every Linear has a bias except lm_head.
// - lm_head is NOT tied to tok_emb (a separate [vocab_size, d_model] weight): simpler to shard
//   and to wrap per module.
// - Dropout (options.dropout, default 0) on the embedding sum, the attention weights and both
//   residual branches, in training mode only; the masks are drawn as ParallelGPT draws them at any
//   tensor-parallel degree (Design note [dropout streams], tensor_parallel/dropout.h; the attention
//   weights' masks so only with the math attention on the CPU: fused attention and GPUs draw their own).
//
// Parameter names (identical in bench/gpt_model.py, the PyTorch twin of this model):
//   tok_emb.weight [V, C]   pos_emb.weight [seq_len, C]
//   blocks.{i}.ln1.{weight,bias} [C]   blocks.{i}.qkv.weight [3C, C]  blocks.{i}.qkv.bias [3C]
//   blocks.{i}.attn_proj.weight [C, C] blocks.{i}.attn_proj.bias [C]
//   blocks.{i}.ln2.{weight,bias} [C]   blocks.{i}.fc.weight [mC, C]   blocks.{i}.fc.bias [mC]
//   blocks.{i}.mlp_proj.weight [C, mC] blocks.{i}.mlp_proj.bias [C]
//   ln_f.{weight,bias} [C]   lm_head.weight [V, C]
//
// Initialisation (init_weights(seed), done by the constructor with options.seed()): walking
// named_parameters() in order, with one CPU generator seeded with `seed`: biases 0, LayerNorm
// weights 1, every other weight ~ normal(0, 0.02) except the residual projections
// (attn_proj.weight, mlp_proj.weight) ~ normal(0, 0.02 / sqrt(2 * layers)) (GPT-2's scaled
// init). Values are drawn on the CPU in float32 and copied, so a seed gives the same weights on
// every device, and the same as bench/gpt_model.py's init_weights(model, seed).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "dtrain/nn/forward_hooks.h"

namespace dtrain::models {

// Every LayerNorm of the GPT and of its stages and tensor-parallel form.
inline constexpr double kLayerNormEps = 1e-5;

struct GPTOptions {
  TORCH_ARG(int64_t, vocab_size) = 256;
  // Maximum sequence length (number of learned positions); forward accepts T <= seq_len.
  TORCH_ARG(int64_t, seq_len) = 256;
  TORCH_ARG(int64_t, layers) = 4;
  TORCH_ARG(int64_t, d_model) = 256;
  // d_model must be divisible by heads.
  TORCH_ARG(int64_t, heads) = 4;
  // MLP hidden width = mlp_ratio * d_model.
  TORCH_ARG(int64_t, mlp_ratio) = 4;
  TORCH_ARG(double, dropout) = 0.0;
  // Attention through at::scaled_dot_product_attention (causal; flash / memory-efficient kernels on
  // CUDA) where libtorch has it (2.0+); libtorch 1.13 has none and always runs the math form
  // (baddbmm, softmax, bmm), as does `false`. The two agree to rounding (tests/models/gpt_test.cpp
  // states the tolerance); with dropout they draw different masks.
  TORCH_ARG(bool, fused_attention) = true;
  // Seed of the constructor's init_weights.
  TORCH_ARG(uint64_t, seed) = 0;
  // Build without values: every parameter is a placeholder of the right shape that holds one
  // element of memory (no rank ever holds the whole model), to be materialised by
  // GPTImpl::initializer() one parameter at a time, e.g. by FSDP's param_init_fn (the large-model
  // path). A deferred model cannot run until then.
  TORCH_ARG(bool, defer_init) = false;
};

// One transformer block. forward: x [B, T, d_model] (float) -> [B, T, d_model]. Its forward runs
// through forward hooks (dtrain/nn/forward_hooks.h), so FSDP and recomputation can wrap it in place.
class GPTBlockImpl : public torch::nn::Cloneable<GPTBlockImpl>, public nn::Hookable {
 public:
  explicit GPTBlockImpl(const GPTOptions& options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  const GPTOptions& options() const { return options_; }

  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear attn_proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::nn::Linear mlp_proj{nullptr};

 private:
  // Additive causal mask [T, T] (0 on and below the diagonal, -inf above), cached per
  // (T, device, dtype). Not a buffer: it is derived state, never saved or broadcast.
  const at::Tensor& causal_mask(int64_t t, const at::Tensor& like);
  at::Tensor body(const at::Tensor& x);

  GPTOptions options_;
  at::Tensor mask_;
};
TORCH_MODULE(GPTBlock);

class GPTImpl : public torch::nn::Cloneable<GPTImpl> {
 public:
  explicit GPTImpl(const GPTOptions& options = {});
  void reset() override;

  // tokens: int64 [B, T] with 1 <= T <= seq_len and values in [0, vocab_size).
  // Returns logits [B, T, vocab_size].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross-entropy of forward(tokens) against targets (int64 [B, T]).
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets);

  // Re-initialises every parameter deterministically from `seed` (see the top of this file).
  void init_weights(uint64_t seed);
  // The same initialisation one parameter at a time: call it with every (name, tensor) of
  // named_parameters(), in that order (the tensor: the parameter's shape, float; written in place).
  std::function<void(const std::string& name, at::Tensor& param)> initializer(uint64_t seed) const;

  // The transformer blocks, in order: holders of the modules registered in the "blocks" list
  // (modifying a block modifies the model).
  std::vector<GPTBlock> blocks() const;
  const GPTOptions& options() const { return options_; }
  int64_t num_parameters() const;
  // Training FLOPs per token at sequence length t (forward + backward, PaLM's count, used for MFU):
  // 6 x (parameters outside the two embeddings: every weight a token goes through in a matmul,
  // lm_head included) + 12 x layers x d_model x t (attention scores and weighted values; the causal
  // half is not discounted). gpt_flops_per_token(options(), t).
  double flops_per_token(int64_t t) const;

  torch::nn::Embedding tok_emb{nullptr};
  torch::nn::Embedding pos_emb{nullptr};
  torch::nn::ModuleList block_list{nullptr};  // registered as "blocks"
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  GPTOptions options_;
};
TORCH_MODULE(GPT);

// GPTImpl::flops_per_token from the options alone (no model built: the same for any shard or
// deferred model of these options).
double gpt_flops_per_token(const GPTOptions& options, int64_t t);

// Mean cross-entropy of logits [..., V] against int64 targets [...] (the language-model loss).
at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace dtrain::models
