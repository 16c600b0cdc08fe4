#include "dtrain/models/gpt_stages.h"

#include <stdexcept>

#include <ATen/ATen.h>

#include "dtrain/tensor_parallel/dropout.h"

namespace dtrain::models {

namespace {

// A stage's module: the GPT's modules it runs, under the GPT's names.
struct GPTStageImpl : torch::nn::Module {};
}  // namespace

// The block range [begin, end) of each of n stages (checked).
std::vector<std::pair<int64_t, int64_t>> stage_ranges(int64_t layers, int n, std::vector<int64_t> starts) {
  if (starts.empty()) starts = pipeline::even_starts(layers, n, "GPT layers");
  if (static_cast<int>(starts.size()) != n || starts.front() != 0)
    throw std::invalid_argument("gpt_stages: " + std::to_string(n) + " stages need " + std::to_string(n) +
                                " first-layer indices beginning with 0");
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int k = 0; k < n; ++k) {
    const int64_t begin = starts[k], end = k + 1 < n ? starts[k + 1] : layers;
    if (end <= begin || end > layers)
      throw std::invalid_argument("gpt_stages: stage " + std::to_string(k) + " would hold layers [" +
                                  std::to_string(begin) + ", " + std::to_string(end) + ") of " + std::to_string(layers));
    out.emplace_back(begin, end);
  }
  return out;
}

std::vector<pipeline::Stage> gpt_stages(const GPT& model, int n, std::vector<int64_t> starts) {
  const int64_t layers = static_cast<int64_t>(model->block_list->size());
  const auto ranges = stage_ranges(layers, n, std::move(starts));
  const GPTOptions opts = model->options();
  const auto all_blocks = model->blocks();
  std::vector<pipeline::Stage> stages;
  for (int k = 0; k < n; ++k) {
    const auto [begin, end] = ranges[k];
    auto m = std::make_shared<GPTStageImpl>();
    const bool first = k == 0, last = k == n - 1;
    torch::nn::Embedding tok{nullptr}, pos{nullptr};
    torch::nn::LayerNorm ln_f{nullptr};
    torch::nn::Linear head{nullptr};
    if (first) {
      tok = m->register_module("tok_emb", model->tok_emb);
      pos = m->register_module("pos_emb", model->pos_emb);
    }
    auto blocks = m->register_module("blocks", std::make_shared<torch::nn::Module>());
    std::vector<GPTBlock> mine;
    for (int64_t i = begin; i < end; ++i) mine.push_back(blocks->register_module(std::to_string(i), all_blocks[i]));
    if (last) {
      ln_f = m->register_module("ln_f", model->ln_f);
      head = m->register_module("lm_head", model->lm_head);
    }
    GPTStageImpl* self = m.get();
    auto forward = [self, tok, pos, mine, ln_f, head, opts, first, last](const at::Tensor& in) mutable {
      at::Tensor x = in;
      if (first) {  // as GPTImpl::forward
        TORCH_CHECK(in.dim() == 2 && in.scalar_type() == at::kLong, "GPT stage 0: expected int64 tokens [B, T], got ",
                    in.sizes(), " ", in.scalar_type());
        const int64_t t = in.size(1);
        TORCH_CHECK(t >= 1 && t <= opts.seq_len(), "GPT: sequence length ", t, " must be in [1, seq_len = ",
                    opts.seq_len(), "]");
        x = at::embedding(tok->weight, in) + pos->weight.narrow(0, 0, t);
        x = tensor_parallel::dropout(x, opts.dropout(), self->is_training());  // as GPTImpl::forward
      }
      for (auto& b : mine) x = b->forward(x);
      if (last) {
        const int64_t b = x.size(0), t = x.size(1), c = opts.d_model();
        at::Tensor x2 = at::layer_norm(x.reshape({b * t, c}), {c}, ln_f->weight, ln_f->bias, kLayerNormEps);
        x = at::mm(x2, head->weight.t()).view({b, t, opts.vocab_size()});
      }
      return x;
    };
    stages.push_back(pipeline::Stage{m, forward});
  }
  return stages;
}

std::vector<pipeline::Stage> gpt_stages(const ParallelGPT& model, int n, std::vector<int64_t> starts) {
  const int64_t layers = static_cast<int64_t>(model->block_list->size());
  const auto ranges = stage_ranges(layers, n, std::move(starts));
  std::vector<pipeline::Stage> stages;
  for (int k = 0; k < n; ++k) {
    const auto [begin, end] = ranges[k];
    auto m = std::make_shared<GPTStageImpl>();
    const bool first = k == 0, last = k == n - 1;
    if (first) {
      m->register_module("tok_emb", model->tok_emb.ptr());
      m->register_module("pos_emb", model->pos_emb.ptr());
    }
    auto blocks = m->register_module("blocks", std::make_shared<torch::nn::Module>());
    std::vector<tensor_parallel::ParallelBlock> mine;
    for (int64_t i = begin; i < end; ++i) {
      mine.push_back(blocks->register_module(
          std::to_string(i), tensor_parallel::ParallelBlock(model->block_list->ptr<tensor_parallel::ParallelBlockImpl>(i))));
    }
    if (last) {
      m->register_module("ln_f", model->ln_f.ptr());
      m->register_module("lm_head", model->lm_head.ptr());
    }
    GPTStageImpl* self = m.get();
    auto forward = [gpt = model, self, mine, first, last](const at::Tensor& in) mutable {
      at::Tensor x = first ? gpt->embed(in, self->is_training()) : in;
      for (auto& b : mine) x = b->forward(x);
      return last ? gpt->head(x) : x;
    };
    stages.push_back(pipeline::Stage{m, forward});
  }
  return stages;
}

}  // namespace dtrain::models
