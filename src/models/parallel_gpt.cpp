#include "dtrain/models/parallel_gpt.h"

#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include "dtrain/tensor_parallel/dropout.h"
#include "dtrain/tensor_parallel/plan.h"
#include "dtrain/tensor_parallel/regions.h"

namespace dtrain::models {

namespace {
}

ParallelGPTImpl::ParallelGPTImpl(const GPTOptions& options, comm::ProcessGroup tp, bool sequence_parallel)
    : options_(options), tp_(std::move(tp)), sequence_parallel_(sequence_parallel) {
  // The layers draw their init from the default generator; like GPT (its own seeded generator)
  // the model leaves the default stream as it found it, so dropout draws the same masks whether
  // the program built a GPT or a ParallelGPT (Design note [dropout streams]).
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  reset();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void ParallelGPTImpl::reset() {
  const int64_t c = options_.d_model();
  tok_emb = register_module("tok_emb", tensor_parallel::VocabParallelEmbedding(options_.vocab_size(), c, tp_));
  pos_emb = register_module("pos_emb", torch::nn::Embedding(options_.seq_len(), c));
  block_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options_.layers(); ++i) {
    block_list->push_back(tensor_parallel::ParallelBlock(options_, tp_, sequence_parallel_));
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c}).eps(kLayerNormEps)));
  lm_head = register_module("lm_head", tensor_parallel::ColumnParallelLinear(
                                           tensor_parallel::ParallelLinearOptions(c, options_.vocab_size())
                                               .bias(false)
                                               .sequence_parallel(sequence_parallel_),
                                           tp_));
}

at::Tensor ParallelGPTImpl::forward(const at::Tensor& tokens) {
  at::Tensor x = embed(tokens, is_training());
  for (const auto& m : *block_list) x = m->as<tensor_parallel::ParallelBlockImpl>()->forward(x);
  return head(x);
}

at::Tensor ParallelGPTImpl::embed(const at::Tensor& tokens, bool training) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "ParallelGPT: expected int64 tokens [B, T], got ",
              tokens.sizes(), " ", tokens.scalar_type());
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t >= 1 && t <= options_.seq_len(), "ParallelGPT: sequence length ", t, " must be in [1, seq_len = ",
              options_.seq_len(), "]");
  at::Tensor x = tok_emb(tokens) + pos_emb->weight.narrow(0, 0, t);  // [B, T, C], the same on every rank
  x = tensor_parallel::dropout_replicated(x, options_.dropout(), training, tp_);  // (Design note [dropout streams])
  // Sequence parallel: from here to the head each rank holds its part of the sequence.
  if (sequence_parallel_) x = tensor_parallel::scatter_to_region(x, tp_, 1);
  return x;
}

at::Tensor ParallelGPTImpl::head(const at::Tensor& x) {
  const at::Tensor w = sequence_parallel_ ? tensor_parallel::copy_to_region(ln_f->weight, tp_) : ln_f->weight;
  const at::Tensor b = sequence_parallel_ ? tensor_parallel::copy_to_region(ln_f->bias, tp_) : ln_f->bias;
  return lm_head(at::layer_norm(x, {options_.d_model()}, w, b, kLayerNormEps));  // [B, T, V / n]
}

at::Tensor ParallelGPTImpl::loss(const at::Tensor& logits, const at::Tensor& targets) const {
  return tensor_parallel::vocab_parallel_cross_entropy(logits, targets, tp_).mean();
}

void ParallelGPTImpl::load_from(const GPTImpl& full) {
  tensor_parallel::load_pieces(*this, full, tensor_parallel::Plan::of(*this, tp_));
}

}  // namespace dtrain::models
