#include "dtrain/models/gpt.h"

#include "dtrain/compat.h"
#include "dtrain/recompute/checkpoint.h"
#include "dtrain/tensor_parallel/dropout.h"

#include <cmath>
#include <limits>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace dtrain::models {
namespace {


void check_options(const GPTOptions& o) {
  TORCH_CHECK(o.vocab_size() >= 1, "GPTOptions: vocab_size must be >= 1, got ", o.vocab_size());
  TORCH_CHECK(o.seq_len() >= 1, "GPTOptions: seq_len must be >= 1, got ", o.seq_len());
  TORCH_CHECK(o.layers() >= 0, "GPTOptions: layers must be >= 0, got ", o.layers());
  TORCH_CHECK(o.d_model() >= 1, "GPTOptions: d_model must be >= 1, got ", o.d_model());
  TORCH_CHECK(o.heads() >= 1 && o.d_model() % o.heads() == 0, "GPTOptions: d_model (",
              o.d_model(), ") must be a positive multiple of heads (", o.heads(),
              "); choose heads that divide d_model");
  TORCH_CHECK(o.mlp_ratio() >= 1, "GPTOptions: mlp_ratio must be >= 1, got ", o.mlp_ratio());
  TORCH_CHECK(o.dropout() >= 0.0 && o.dropout() < 1.0, "GPTOptions: dropout must be in [0, 1), got ",
              o.dropout());
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// y = x @ w^T + b for 2-D x, as one GEMM.
inline at::Tensor linear2d(const at::Tensor& x, const torch::nn::Linear& l) {
  return at::addmm(l->bias, x, l->weight.t());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
GPTBlockImpl::GPTBlockImpl(const GPTOptions& options) : options_(options) {
  check_options(options_);
  reset();
}

void GPTBlockImpl::reset() {
  const int64_t c = options_.d_model();
  const int64_t hidden = options_.mlp_ratio() * c;
  auto ln = [&] { return torch::nn::LayerNormOptions({c}).eps(kLayerNormEps); };
  ln1 = register_module("ln1", torch::nn::LayerNorm(ln()));
  qkv = register_module("qkv", torch::nn::Linear(c, 3 * c));
  attn_proj = register_module("attn_proj", torch::nn::Linear(c, c));
  ln2 = register_module("ln2", torch::nn::LayerNorm(ln()));
  fc = register_module("fc", torch::nn::Linear(c, hidden));
  mlp_proj = register_module("mlp_proj", torch::nn::Linear(hidden, c));
  mask_ = at::Tensor();
}

const at::Tensor& GPTBlockImpl::causal_mask(int64_t t, const at::Tensor& like) {
  if (!mask_.defined() || mask_.size(0) != t || mask_.device() != like.device() ||
      mask_.scalar_type() != like.scalar_type()) {
    mask_ = at::full({t, t}, -std::numeric_limits<double>::infinity(), like.options()).triu_(1);
  }
  return mask_;
}

at::Tensor GPTBlockImpl::forward(const at::Tensor& x) {
  return forward_hooks().run({x}, [this](const nn::Tensors& in) { return nn::Tensors{body(in[0])}; })[0];
}

at::Tensor GPTBlockImpl::body(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == options_.d_model(),
              "GPTBlock: expected input [B, T, d_model = ", options_.d_model(), "], got ",
              x.sizes());
  const int64_t b = x.size(0), t = x.size(1), c = x.size(2);
  const int64_t h = options_.heads(), d = c / h;
  const double p = is_training() ? options_.dropout() : 0.0;

  at::Tensor x2 = x.reshape({b * t, c});  // a view when x is contiguous (it is in GPT)

  // --- causal self-attention ---
  at::Tensor a = at::layer_norm(x2, {c}, ln1->weight, ln1->bias, kLayerNormEps);
  a = linear2d(a, qkv);  // [B*T, 3C]: q | k | v
  at::Tensor y;
  if (options_.fused_attention() && compat::kHaveSdpa) {
    // No copy: SDPA takes q, k, v as [B, H, T, D] views of [B, T, 3, H, D] (their last dimension
    // dense, as its kernels need), and its backward writes their gradient in [B*T, 3C] order with
    // one stack (as PyTorch GPTs pass them; the head-major copy below cost two copies per layer).
    auto parts = a.view({b, t, 3, h, d}).unbind(2);  // each [B, T, H, D]
    y = compat::sdpa_causal(parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2), p);
  } else {
    // One copy puts q, k, v head-major: [3, B, H, T, D]. unbind (not three selects) so that the
    // backward assembles the gradient with a single stack instead of three zero-filled buffers.
    auto qkv_heads = a.view({b, t, 3, h, d}).permute({2, 0, 3, 1, 4}).contiguous().unbind(0);
    const at::Tensor q = qkv_heads[0].view({b * h, t, d});
    const at::Tensor k = qkv_heads[1].view({b * h, t, d});
    const at::Tensor v = qkv_heads[2].view({b * h, t, d});
    // scores = mask + q k^T / sqrt(D), fused into one batched GEMM (the mask broadcasts).
    at::Tensor att = at::baddbmm(causal_mask(t, q), q, k.transpose(1, 2), /*beta=*/1.0,
                                 /*alpha=*/1.0 / std::sqrt(static_cast<double>(d)));
    att = at::softmax(att, -1);
    // On the CPU the masks a ParallelGPT draws at any degree (Design note [dropout streams]); on a
    // GPU the device's own dropout (dropout_heads draws on the CPU and copies).
    if (p > 0.0) {
      att = att.is_cpu() ? tensor_parallel::dropout_heads(att.view({b, h, t, t}), p, true, 0).view({b * h, t, t})
                         : at::dropout(att, p, /*train=*/true);
    }
    y = at::bmm(att, v);  // [B*H, T, D]
  }
  y = (y.dim() == 4 ? y : y.view({b, h, t, d})).transpose(1, 2).reshape({b * t, c});  // [B*T, C]
  y = linear2d(y, attn_proj);
  y = tensor_parallel::dropout(y, p, p > 0.0);
  x2 = x2 + y;

  // --- MLP ---
  at::Tensor m = at::layer_norm(x2, {c}, ln2->weight, ln2->bias, kLayerNormEps);
  m = at::gelu(linear2d(m, fc));
  m = linear2d(m, mlp_proj);
  m = tensor_parallel::dropout(m, p, p > 0.0);
  x2 = x2 + m;
  return x2.view({b, t, c});
}

// ---------------------------------------------------------------------------------------------
GPTImpl::GPTImpl(const GPTOptions& options) : options_(options) {
  check_options(options_);
  reset();
  if (!options_.defer_init()) init_weights(options_.seed());
}

void GPTImpl::reset() {
  const int64_t c = options_.d_model();
  // With defer_init each submodule's parameters become placeholders as soon as it exists, so
  // building never holds more than one submodule's values.
  auto placeholders = [this](torch::nn::Module& m) {
    if (!options_.defer_init()) return;
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.set_data(at::zeros({}, p.options()).expand(p.sizes()));
  };
  tok_emb = register_module("tok_emb", torch::nn::Embedding(options_.vocab_size(), c));
  placeholders(*tok_emb);
  pos_emb = register_module("pos_emb", torch::nn::Embedding(options_.seq_len(), c));
  placeholders(*pos_emb);
  block_list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options_.layers(); ++i) {
    GPTBlock block(options_);
    placeholders(*block);
    block_list->push_back(block);
  }
  ln_f = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c}).eps(kLayerNormEps)));
  placeholders(*ln_f);
  lm_head = register_module(
      "lm_head", torch::nn::Linear(torch::nn::LinearOptions(c, options_.vocab_size()).bias(false)));
  placeholders(*lm_head);
}

void GPTImpl::init_weights(uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto init = initializer(seed);
  for (auto& item : named_parameters(/*recurse=*/true)) {
    const auto& p = item.value();
    TORCH_CHECK(p.storage().nbytes() >= static_cast<size_t>(p.numel() * p.element_size()),
                "GPT::init_weights: parameter ", item.key(), " is a deferred placeholder (GPTOptions::defer_init); "
                "materialise it with initializer() into real storage (e.g. FSDP's param_init_fn)");
    init(item.key(), item.value());
  }
}

std::function<void(const std::string&, at::Tensor&)> GPTImpl::initializer(uint64_t seed) const {
  auto gen = std::make_shared<at::Generator>(at::make_generator<at::CPUGeneratorImpl>(seed));
  const double std_default = 0.02;
  const double std_resid =
      0.02 / std::sqrt(2.0 * static_cast<double>(std::max<int64_t>(options_.layers(), 1)));
  return [gen, std_default, std_resid](const std::string& name, at::Tensor& param) {
    torch::NoGradGuard no_grad;
    if (ends_with(name, ".bias")) {
      param.zero_();
    } else if (ends_with(name, "ln1.weight") || ends_with(name, "ln2.weight") || name == "ln_f.weight") {
      param.fill_(1.0);
    } else {
      const double sd = (ends_with(name, "attn_proj.weight") || ends_with(name, "mlp_proj.weight"))
                            ? std_resid
                            : std_default;
      at::Tensor values = at::empty(param.sizes(), at::TensorOptions().dtype(at::kFloat));
      values.normal_(0.0, sd, *gen);
      param.copy_(values);
    }
  };
}

at::Tensor GPTImpl::forward(const at::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "GPT: expected tokens [B, T], got shape ", tokens.sizes());
  TORCH_CHECK(tokens.scalar_type() == at::kLong, "GPT: tokens must be int64 (torch::kLong), got ",
              tokens.scalar_type());
  const int64_t b = tokens.size(0), t = tokens.size(1), c = options_.d_model();
  TORCH_CHECK(t >= 1 && t <= options_.seq_len(), "GPT: sequence length ", t,
              " must be in [1, seq_len = ", options_.seq_len(),
              "]; build the model with a larger GPTOptions::seq_len or feed shorter windows");
  // [B, T, C] + [T, C]
  at::Tensor x = at::embedding(tok_emb->weight, tokens) + pos_emb->weight.narrow(0, 0, t);
  x = tensor_parallel::dropout(x, options_.dropout(), is_training());
  // The registered list is the source of truth (clone() replaces its contents).
  // (Activation checkpointing, when on, is a forward hook of each block: see reset().)
  for (const auto& m : *block_list) x = m->as<GPTBlockImpl>()->forward(x);
  at::Tensor x2 = at::layer_norm(x.view({b * t, c}), {c}, ln_f->weight, ln_f->bias, kLayerNormEps);
  return at::mm(x2, lm_head->weight.t()).view({b, t, options_.vocab_size()});
}

at::Tensor GPTImpl::loss(const at::Tensor& tokens, const at::Tensor& targets) {
  return gpt_loss(forward(tokens), targets);
}

std::vector<GPTBlock> GPTImpl::blocks() const {
  std::vector<GPTBlock> out;
  out.reserve(block_list->size());
  for (size_t i = 0; i < block_list->size(); ++i) out.emplace_back(block_list->ptr<GPTBlockImpl>(i));
  return out;
}

int64_t GPTImpl::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

double GPTImpl::flops_per_token(int64_t t) const { return gpt_flops_per_token(options_, t); }

double gpt_flops_per_token(const GPTOptions& options, int64_t t) {
  // From the options, not parameters(): the same whether the model is sharded or deferred.
  const double c = static_cast<double>(options.d_model()), m = static_cast<double>(options.mlp_ratio());
  const double layers = static_cast<double>(options.layers());
  const double per_block = (3 * c * c + 3 * c) + (c * c + c) + 4 * c + (m * c * c + m * c) + (m * c * c + c);
  const double matmul_params = layers * per_block + 2 * c + static_cast<double>(options.vocab_size()) * c;
  return 6.0 * matmul_params + 12.0 * layers * c * static_cast<double>(t);
}

at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() >= 1, "gpt_loss: logits must be [..., vocab], got ", logits.sizes());
  const int64_t v = logits.size(-1);
  TORCH_CHECK(targets.numel() * v == logits.numel(), "gpt_loss: targets ", targets.sizes(),
              " do not match logits ", logits.sizes(), " (expected logits = targets shape + [vocab])");
  return at::cross_entropy_loss(logits.reshape({-1, v}), targets.reshape({-1}));
}

}  // namespace dtrain::models
