// Activation checkpointing: identical gradients (also with dropout), the module wrapper on the
// demo's transformer block, and DDP on top.
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/models/gpt.h"
#include "dtrain/recompute/checkpoint.h"
#include "testing/testing.h"

using namespace dtrain;

namespace {

struct BlockNetImpl : torch::nn::Module {
  explicit BlockNetImpl(bool checkpointed) : checkpointed(checkpointed) {
    for (int i = 0; i < 3; ++i) {
      auto b = models::GPTBlock(models::GPTOptions().d_model(16).heads(2).seq_len(8).dropout(0.1));
      if (checkpointed) {
        wrapped.push_back(register_module("block" + std::to_string(i), recompute::CheckpointWrapper<models::GPTBlock>(b)));
      } else {
        plain.push_back(register_module("block" + std::to_string(i), b));
      }
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& b : plain) h = b->forward(h);
    for (auto& b : wrapped) h = b->forward(h);
    return h;
  }
  bool checkpointed;
  std::vector<models::GPTBlock> plain;
  std::vector<recompute::CheckpointWrapper<models::GPTBlock>> wrapped;
};
TORCH_MODULE(BlockNet);

BlockNet make(bool checkpointed) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(11);
  return BlockNet(checkpointed);
}

std::vector<at::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<at::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().clone());
  return g;
}

}  // namespace

namespace {

// Gradients through checkpoint() equal the plain run's bit for bit, with dropout drawing from the
// generator of `device` (the CPU's, or a CUDA device's: the recomputation replays that one too).
void expect_identical_gradients_with_dropout(const c10::Device& device) {
  torch::manual_seed(0);
  torch::nn::Linear l1(5, 7), l2(7, 3);
  l1->to(device);
  l2->to(device);
  auto x = at::randn({4, 5}, at::TensorOptions().device(device)).requires_grad_();
  auto f = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{l2(at::dropout(at::tanh(l1(in[0])), 0.5, true))};
  };
  std::vector<at::Tensor> params = l1->parameters();
  for (auto& p : l2->parameters()) params.push_back(p);
  auto draw = [&] { return at::rand({1}, at::TensorOptions().device(device)).item<double>(); };

  torch::manual_seed(42);
  f({x})[0].pow(2).sum().backward();
  auto expect_x = x.grad().clone();
  std::vector<at::Tensor> expect;
  for (auto& p : params) expect.push_back(p.grad().clone());
  const double after_plain = draw();

  x.mutable_grad() = at::Tensor();
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  torch::manual_seed(42);
  auto y = recompute::checkpoint(f, {x}, params)[0];
  EXPECT_TRUE(y.requires_grad());
  // A draw between forward and backward must not disturb the recomputation's dropout mask.
  (void)draw();
  y.pow(2).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), expect_x));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].grad(), expect[i])) << i;
  // The random stream after backward continues from where the program left it, not the replay.
  torch::manual_seed(42);
  f({x});
  EXPECT_EQ(draw(), after_plain);
}

}  // namespace

TEST(Checkpoint, FunctionFormGivesIdenticalGradientsWithDropout) {
  expect_identical_gradients_with_dropout(c10::Device(c10::kCPU));
}

// Never run here (no GPU has been lent to this project): skipped without CUDA.
TEST(Checkpoint, FunctionFormGivesIdenticalGradientsWithDropoutOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  expect_identical_gradients_with_dropout(c10::Device(c10::kCUDA, 0));
}

namespace {

// A layer with dropout (in training mode) that counts its forward calls.
struct DropLinearImpl : torch::nn::Module {
  DropLinearImpl() : fc(register_module("fc", torch::nn::Linear(6, 5))) {}
  at::Tensor forward(const at::Tensor& x) {
    ++calls;
    return fc(at::dropout(x, 0.5, is_training()));
  }
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(DropLinear);

// One call from seed 42: its output, how many times the layer ran, and the CPU's next draw after
// it (a call that used another amount of the random stream shows there).
struct Seeded {
  at::Tensor out;
  int calls = 0;
  double next_draw = 0;
};
Seeded seeded(DropLinear& m, const std::function<at::Tensor()>& call) {
  m->calls = 0;
  torch::manual_seed(42);
  Seeded s;
  s.out = call();
  s.calls = m->calls;
  s.next_draw = at::rand({1}).item<double>();
  return s;
}

// Backward from `out`; returns the gradients of x and of m's parameters and clears them.
std::vector<at::Tensor> backward_grads(const at::Tensor& out, at::Tensor& x, DropLinear& m) {
  out.pow(2).sum().backward();
  std::vector<at::Tensor> g{x.grad().clone()};
  x.mutable_grad() = at::Tensor();
  for (auto& p : m->parameters()) {
    g.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  return g;
}

}  // namespace

// checkpoint() has nothing to recompute under no_grad or when nothing needs a gradient, and the
// module form skips it in eval mode: each must run the function once, from the caller's random
// state, and return that call's result, bit for bit the plain call's (dropout makes a wrong random
// state, a second call, or another call's result show). In training mode with grad the output is
// the plain one too, and backward recomputes it once with the same dropout mask.
TEST(Checkpoint, NoGradEvalAndTrainingGiveThePlainOutputs) {
  torch::manual_seed(0);
  DropLinear m;
  recompute::CheckpointWrapper<DropLinear> wrapped(m);  // shares m's parameters
  auto x = at::randn({4, 6}).requires_grad_();
  const recompute::Fn f = [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{m->forward(in[0])}; };
  auto plain = [&] { return m->forward(x); };
  auto fn_form = [&] { return recompute::checkpoint(f, {x}, m->parameters())[0]; };
  auto module_form = [&] { return wrapped->forward(x); };
  auto expect_same = [](const Seeded& got, const Seeded& want, const std::string& what) {
    EXPECT_TRUE(at::equal(got.out, want.out)) << what;
    EXPECT_EQ(got.calls, 1) << what;
    EXPECT_EQ(got.next_draw, want.next_draw) << what << ": used another amount of the random stream";
  };

  {  // Training mode under no_grad.
    at::NoGradGuard no_grad;
    const Seeded want = seeded(m, plain);
    torch::manual_seed(43);
    ASSERT_FALSE(at::equal(m->forward(x), want.out)) << "the output must depend on the random state";
    const Seeded fn = seeded(m, fn_form), mod = seeded(m, module_form);
    expect_same(fn, want, "no_grad, function form");
    expect_same(mod, want, "no_grad, module form");
    EXPECT_FALSE(fn.out.requires_grad());
    EXPECT_FALSE(mod.out.requires_grad());
  }

  {  // Grad enabled, but neither the input nor a parameter requires a gradient.
    const auto frozen = x.detach();
    for (auto& p : m->parameters()) p.requires_grad_(false);
    const Seeded want = seeded(m, [&] { return m->forward(frozen); });
    const Seeded got = seeded(m, [&] { return recompute::checkpoint(f, {frozen}, m->parameters())[0]; });
    for (auto& p : m->parameters()) p.requires_grad_(true);
    expect_same(got, want, "nothing requires grad");
    EXPECT_FALSE(got.out.requires_grad());
  }

  {  // Eval mode with grad: the wrapper runs the module as it is, attached to autograd as usual.
    wrapped->train(false);
    ASSERT_FALSE(m->is_training());
    const Seeded want = seeded(m, plain);
    const auto want_grads = backward_grads(want.out, x, m);
    const Seeded got = seeded(m, module_form);
    expect_same(got, want, "eval");
    ASSERT_TRUE(got.out.requires_grad()) << "eval output cut off from autograd";
    const auto got_grads = backward_grads(got.out, x, m);
    EXPECT_EQ(m->calls, 1) << "eval: backward recomputed the call";
    for (size_t i = 0; i < want_grads.size(); ++i) EXPECT_TRUE(at::equal(got_grads[i], want_grads[i])) << "eval " << i;
    wrapped->train(true);
  }

  {  // Training mode with grad: the recompute node.
    ASSERT_TRUE(m->is_training());
    const Seeded want = seeded(m, plain);
    const auto want_grads = backward_grads(want.out, x, m);
    auto check = [&](const std::function<at::Tensor()>& call, const std::string& what) {
      const Seeded got = seeded(m, call);  // draws between forward and backward: the replay must not see it
      expect_same(got, want, what);
      ASSERT_TRUE(got.out.requires_grad()) << what;
      const auto got_grads = backward_grads(got.out, x, m);
      EXPECT_EQ(m->calls, 2) << what << ": backward recomputes the call once";
      for (size_t i = 0; i < want_grads.size(); ++i) EXPECT_TRUE(at::equal(got_grads[i], want_grads[i])) << what << " " << i;
    };
    check(fn_form, "training, function form");
    check(module_form, "training, module form");
  }
}

TEST(Checkpoint, WrapperOnTransformerBlocksMatchesPlain) {
  auto x = at::randn({2, 8, 16});
  BlockNet plain = make(false), ckpt = make(true);
  torch::manual_seed(5);
  plain->forward(x).sum().backward();
  torch::manual_seed(5);
  ckpt->forward(x).sum().backward();
  auto a = grads_of(*plain), b = grads_of(*ckpt);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::allclose(a[i], b[i], 1e-6, 1e-7)) << i;
  // Same parameter names as the unwrapped model, under "module." per wrapper.
  EXPECT_TRUE(ckpt->named_parameters().contains("block0.module.qkv.weight"));
}

TEST(Checkpoint, UnderDdpMatchesSingleProcess) {
  // DDP's gradient hooks fire in the outer backward: two ranks with checkpointed blocks train
  // like one process without checkpointing (no dropout here: ranks draw different masks).
  const int W = 2, B = 2;
  auto data = [](int step) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(900 + step);
    return at::randn({W * B, 8, 16}, g);
  };
  auto make_block = []() {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    torch::manual_seed(21);
    return models::GPTBlock(models::GPTOptions().d_model(16).heads(2).seq_len(8));
  };
  // Reference: one process, whole batch, plain block.
  auto ref = make_block();
  // SGD: AdamW would amplify rounding noise in gradients that are zero in exact arithmetic (the key
  // part of qkv.bias: softmax ignores a shift of every key).
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int t = 0; t < 5; ++t) {
    ref_opt.zero_grad();
    ref->forward(data(t)).pow(2).mean().backward();
    ref_opt.step();
  }
  dtrain::testing::run_ranks(W, [&](comm::ProcessGroup& pg) {
    auto model = ddp::DistributedDataParallel<recompute::CheckpointWrapper<models::GPTBlock>>(
        recompute::CheckpointWrapper<models::GPTBlock>(make_block()), pg);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int t = 0; t < 5; ++t) {
      opt.zero_grad();
      model->forward(data(t).narrow(0, pg.rank() * B, B)).pow(2).mean().backward();
      opt.step();
    }
    auto mine = model->module()->module()->named_parameters();
    auto expect = ref->parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_LT(((mine[i].value() - expect[i]).abs().max() / expect[i].abs().max()).item<double>(), 1e-5) << mine[i].key();
    }
  });
}
