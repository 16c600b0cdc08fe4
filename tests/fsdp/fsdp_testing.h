#pragma once
// Shared by the FSDP tests: tiny models (a GPT, and small nets with Hookable units, tied, frozen
// parameters and buffers), deterministic data, one training loop for plain and FSDP-wrapped models,
// and comparisons of full state dicts against single-process training.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/ordered_dict.h>

#include "dtrain/comm.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/models/gpt.h"
#include "dtrain/nn/forward_hooks.h"
#include "testing/models.h"
#include "testing/testing.h"

namespace dtrain::fsdp_testing {

using dtrain::testing::max_rel_diff;
using Dict = torch::OrderedDict<std::string, at::Tensor>;

// ---------------------------------------------------------------------------------------------
// Models

constexpr int64_t kVocab = 32, kSeq = 8;


inline models::GPTOptions tiny_gpt_options(uint64_t seed = 3, int64_t layers = 2) {
  return models::GPTOptions().vocab_size(kVocab).seq_len(kSeq).layers(layers).d_model(16).heads(2).seed(seed);
}
inline models::GPT make_gpt(uint64_t seed = 3, int64_t layers = 2) { return models::GPT(tiny_gpt_options(seed, layers)); }

// y = tanh((x W^T + b) * alpha) * gain: a Hookable unit with three parameters (weight, bias, alpha)
// and a buffer (gain). `shared_weight` ties the weight to another module's.
struct HookLinearImpl : torch::nn::Module, nn::Hookable {
  HookLinearImpl(int64_t in, int64_t out, at::Tensor shared_weight = {}) {
    weight = shared_weight.defined() ? register_parameter("weight", shared_weight)
                                     : register_parameter("weight", at::randn({out, in}) / std::sqrt(double(in)));
    bias = register_parameter("bias", at::randn({out}) * 0.1);
    alpha = register_parameter("alpha", 1.0 + at::randn({out}) * 0.1);
    gain = register_buffer("gain", at::linspace(0.5, 1.5, out));
  }
  at::Tensor forward(const at::Tensor& x) {
    return forward_hooks().run({x}, [this](const nn::Tensors& in) {
      return nn::Tensors{at::tanh((at::linear(in[0], weight, bias)) * alpha) * gain};
    })[0];
  }
  at::Tensor weight, bias, alpha, gain;
};
TORCH_MODULE(HookLinear);

// in (Linear 6->16, root) -> u (HookLinear) -> v (HookLinear) -> out (Linear 16->3) * scale.
// tie: v.weight IS u.weight (used in two units). freeze: u.bias (next to the trainable u.alpha
// in unit u) and the root's scale are frozen. Buffers: count (forwards so far), u.gain, v.gain.
struct ToyNetImpl : torch::nn::Module {
  ToyNetImpl(bool tie, bool freeze) {
    in = register_module("in", torch::nn::Linear(6, 16));
    u = register_module("u", HookLinear(16, 16));
    v = register_module("v", HookLinear(16, 16, tie ? u->weight : at::Tensor()));
    out = register_module("out", torch::nn::Linear(16, 3));
    scale = register_parameter("scale", at::linspace(0.5, 1.5, 3), /*requires_grad=*/!freeze);
    count = register_buffer("count", at::zeros({1}));
    if (freeze) u->bias.requires_grad_(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    {
      at::NoGradGuard no_grad;
      count.add_(1);
    }
    return out(v(u(at::tanh(in(x))))) * scale;
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  HookLinear u{nullptr}, v{nullptr};
  at::Tensor scale, count;
};
TORCH_MODULE(ToyNet);

inline ToyNet make_toy(uint64_t seed, bool tie = true, bool freeze = true) {
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  torch::manual_seed(seed);
  return ToyNet(tie, freeze);
}

// A unit inside a unit: in (Linear, root) -> group [pre (Linear), inner1, inner2 (HookLinear)] -> out.
struct GroupImpl : torch::nn::Module, nn::Hookable {
  GroupImpl() {
    pre = register_module("pre", torch::nn::Linear(16, 16));
    inner1 = register_module("inner1", HookLinear(16, 16));
    inner2 = register_module("inner2", HookLinear(16, 16));
  }
  at::Tensor forward(const at::Tensor& x) {
    return forward_hooks().run({x}, [this](const nn::Tensors& in) {
      return nn::Tensors{inner2(inner1(at::tanh(pre(in[0]))))};
    })[0];
  }
  torch::nn::Linear pre{nullptr};
  HookLinear inner1{nullptr}, inner2{nullptr};
};
TORCH_MODULE(Group);

struct NestedNetImpl : torch::nn::Module {
  NestedNetImpl() {
    in = register_module("in", torch::nn::Linear(6, 16));
    group = register_module("group", Group());
    out = register_module("out", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return out(group(at::tanh(in(x)))); }
  torch::nn::Linear in{nullptr}, out{nullptr};
  Group group{nullptr};
};
TORCH_MODULE(NestedNet);

inline NestedNet make_nested(uint64_t seed) {
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  torch::manual_seed(seed);
  return NestedNet();
}

// ---------------------------------------------------------------------------------------------
// Data: step t's global batch; rank r of W takes rows [(m * W + r) * B, +B) for micro-batch m.

enum class Data { Gpt, Vec };  // GPT tokens -> next tokens, or 6 -> 3 regression

struct Batch {
  at::Tensor x, y;
  Batch slice(int64_t begin, int64_t n) const { return {x.narrow(0, begin, n), y.narrow(0, begin, n)}; }
};

inline Batch global_batch(Data d, int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5000 + step);
  if (d == Data::Gpt) {
    auto opts = at::TensorOptions().dtype(at::kLong);
    auto x = at::randint(0, kVocab, {rows, kSeq}, gen, opts);
    auto y = at::randint(0, kVocab, {rows, kSeq}, gen, opts);
    return {x, y};
  }
  auto x = at::randn({rows, 6}, gen);
  auto y = at::randn({rows, 3}, gen);
  return {x, y};
}

inline at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) {
  return y.scalar_type() == at::kLong ? models::gpt_loss(out, y) : at::mse_loss(out, y);
}

// ---------------------------------------------------------------------------------------------
// Training

enum class Opt { AdamW, SgdMomentum, Sgd };

// AdamW's eps: 1e-4, not libtorch's 1e-8. Adam divides by sqrt(v) + eps, so a gradient that is
// pure rounding noise (e.g. the attention key bias, whose exact gradient is 0: softmax ignores a
// constant added to every score) still moves its parameter by a full step with eps 1e-8. Summing a
// batch in one process or as W per-rank means rounds differently, and those steps then differ by
// up to 5e-4 relative after 10 steps even between two single-process runs (one summing the whole
// batch, one averaging W slices), whatever FSDP does. eps 1e-4 keeps that noise out (the same
// comparison then agrees to 2e-6) while real gradients (1e-3 and up here) still get Adam's steps.
// The float64 parity test uses the default eps.
constexpr double kAdamEps = 1e-4;

inline std::unique_ptr<torch::optim::Optimizer> make_opt(Opt o, std::vector<at::Tensor> params,
                                                         double adam_eps = kAdamEps) {
  switch (o) {
    case Opt::AdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(adam_eps));
    case Opt::SgdMomentum:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
    case Opt::Sgd:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  }
  return nullptr;
}

// A module's distinct parameters (a tied tensor once: libtorch's parameters() lists it per name).
inline std::vector<at::Tensor> unique_params(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  std::set<const void*> seen;
  for (const auto& p : m.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

struct TrainSpec {
  Data data = Data::Gpt;
  int per_rank = 2;  // rows per rank and micro-batch (the single process takes world * per_rank * micro)
  int steps = 10;
  Opt opt = Opt::AdamW;
  int micro = 1;         // micro-batches per step (gradient accumulation)
  bool no_sync = true;   // FSDP: all but the last micro-batch under no_sync()
  double clip = 0;       // > 0: clip the gradient norm to this before each step
  double clip_type = 2.0;
  double adam_eps = kAdamEps;
};

inline std::unique_ptr<torch::optim::Optimizer> make_opt(const TrainSpec& s, std::vector<at::Tensor> params) {
  return make_opt(s.opt, std::move(params), s.adam_eps);
}

struct StepLog {
  std::vector<double> losses;  // this rank's loss per step (sum of the micro-batch losses / micro)
  std::vector<double> norms;   // gradient norms before clipping
};

template <class T>
struct IsFsdp : std::false_type {};
template <class M>
struct IsFsdp<fsdp::FullyShardedDataParallel<M>> : std::true_type {};

// Trains `model` (a plain module holder, or FSDP around one) with spec.steps optimizer steps as
// rank `rank` of `world` (a plain single-process reference: rank 0 of world 1, with per_rank
// holding the whole global batch and micro 1).
template <class Holder>
StepLog train(Holder& model, torch::optim::Optimizer& opt, const TrainSpec& s, int rank, int world) {
  StepLog log;
  for (int t = 0; t < s.steps; ++t) {
    opt.zero_grad();
    auto g = global_batch(s.data, t, int64_t(world) * s.per_rank * s.micro);
    double loss_sum = 0;
    for (int m = 0; m < s.micro; ++m) {
      auto b = g.slice((int64_t(m) * world + rank) * s.per_rank, s.per_rank);
      auto run = [&] {
        auto l = loss_of(model->forward(b.x), b.y) / s.micro;
        l.backward();
        loss_sum += l.template item<double>();
      };
      if constexpr (IsFsdp<Holder>::value) {
        if (s.no_sync && m + 1 < s.micro) {
          auto guard = model->no_sync();
          run();
        } else {
          run();
        }
      } else {
        run();
      }
    }
    if (s.clip > 0) {
      if constexpr (IsFsdp<Holder>::value) {
        log.norms.push_back(model->clip_grad_norm(s.clip, s.clip_type));
      } else {
        std::vector<at::Tensor> with_grad;
        for (auto& p : unique_params(*model)) {
          if (p.grad().defined()) with_grad.push_back(p);
        }
        log.norms.push_back(torch::nn::utils::clip_grad_norm_(with_grad, s.clip, s.clip_type));
      }
    }
    opt.step();
    log.losses.push_back(loss_sum);
  }
  return log;
}

// Parameters and buffers of a plain module, cloned (tied parameters under each of their names).
inline Dict named_values(const torch::nn::Module& m) {
  Dict d;
  for (const auto& it : m.named_parameters()) d.insert(it.key(), it.value().detach().clone());
  for (const auto& it : m.named_buffers()) d.insert(it.key(), it.value().detach().clone());
  return d;
}

struct Reference {
  Dict values;  // after training
  StepLog log;
};

// Single-process training of `model` over the same global batches as `world` ranks of `s`.
template <class Holder>
Reference train_reference(Holder model, TrainSpec s, int world) {
  s.per_rank *= world * s.micro;
  s.micro = 1;
  auto opt = make_opt(s, unique_params(*model));
  Reference ref;
  ref.log = train(model, *opt, s, 0, 1);
  ref.values = named_values(*model);
  return ref;
}

// `actual` has exactly the keys and shapes of `expect`, every value within `tol` (max |a-b| / max |b|).
inline void expect_dicts_close(const Dict& actual, const Dict& expect, double tol, const std::string& what) {
  std::set<std::string> a, e;
  for (const auto& it : actual) a.insert(it.key());
  for (const auto& it : expect) e.insert(it.key());
  EXPECT_EQ(a, e) << what << ": state dict keys";
  EXPECT_EQ(actual.size(), expect.size()) << what;
  for (const auto& it : expect) {
    const at::Tensor* got = actual.find(it.key());
    if (!got) continue;
    ASSERT_EQ(got->sizes(), it.value().sizes()) << what << ": shape of " << it.key();
    EXPECT_EQ(got->scalar_type(), it.value().scalar_type()) << what << ": dtype of " << it.key();
    if (tol == 0) {
      EXPECT_TRUE(at::equal(*got, it.value())) << what << ": " << it.key() << " not bitwise equal, max diff "
                                               << (*got - it.value()).abs().max().item<double>();
    } else {
      const auto a = got->to(at::kDouble), b = it.value().to(at::kDouble);
      EXPECT_LT(max_rel_diff(a, b), tol) << what << ": " << it.key() << ", worst at flat index "
                                         << (a - b).abs().reshape({-1}).argmax().item<int64_t>() << " of "
                                         << b.numel();
    }
  }
}

// Test names for (strategy, world size) parameters: "full_W2".
struct StrategyWorldName {
  template <class Info>
  std::string operator()(const Info& info) const {
    return std::string(fsdp::to_string(std::get<0>(info.param))) + "_W" + std::to_string(std::get<1>(info.param));
  }
};

inline fsdp::FullyShardedOptions by_block(fsdp::FullyShardedOptions o = {}) {
  return o.wrap_policy(fsdp::WrapPolicy::by_type<models::GPTBlockImpl>());
}

// The backward schedules of Design note [backward memory]: (backward_prefetch, overlap_reduction)
// and how many block-sized buffers (full parameters or flat gradients) each holds in a block's
// backward.
struct BackwardMode {
  fsdp::BackwardPrefetch prefetch;
  bool overlap_reduction;
  int block_buffers;
  fsdp::FullyShardedOptions apply(fsdp::FullyShardedOptions o) const {
    return o.backward_prefetch(prefetch).overlap_reduction(overlap_reduction);
  }
  std::string name() const {
    return std::string(fsdp::to_string(prefetch)) + (overlap_reduction ? "_overlap" : "_serial");
  }
};

inline std::vector<BackwardMode> backward_modes() {
  using P = fsdp::BackwardPrefetch;
  return {{P::BeforeBackward, true, 4}, {P::None, true, 3},       {P::AfterBackward, true, 3},
          {P::BeforeBackward, false, 3}, {P::AfterBackward, false, 2}, {P::None, false, 2}};
}

// Index of the unit named `name` ("" the root), or -1.
inline int unit_index(const fsdp::FullyShardedState& s, const std::string& name) {
  for (size_t i = 0; i < s.units().size(); ++i) {
    if (s.units()[i]->name == name) return static_cast<int>(i);
  }
  return -1;
}

// Names of the parameters a unit's FlatParams hold.
inline std::set<std::string> unit_param_names(const fsdp::Unit& u) {
  std::set<std::string> names;
  for (const auto& f : u.flats) {
    for (const auto& e : f->entries()) names.insert(e.name);
  }
  return names;
}

}  // namespace dtrain::fsdp_testing
