// optim::ForeachAdamW (Design note [multi-tensor AdamW]) equals libtorch's AdamW to rounding (its
// first moment is PyTorch's lerp): parameters and state after steps with weight decay, a parameter
// without a gradient, two groups with different options, a parameter that joins later (another
// step count), and amsgrad (which takes libtorch's own path: bit for bit); its state is
// AdamWParamState under the same keys. And it equals PyTorch's foreach arithmetic
// (_multi_tensor_adamw), written out one tensor at a time, bit for bit.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "dtrain/compat.h"
#include "dtrain/optim/adamw.h"

namespace {

template <class Optimizer>
auto key(Optimizer& o, const at::Tensor& p) {
  return dtrain::compat::optimizer_state_key<std::decay_t<decltype(o.state())>>(p);
}

std::vector<torch::Tensor> make_params(int64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> ps;
  for (auto shape : std::vector<std::vector<int64_t>>{{7, 5}, {5}, {3, 4, 2}, {1}, {6}}) {
    ps.push_back(torch::randn(shape).requires_grad_(true));
  }
  return ps;
}

std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// The same gradients on both sets: random, except parameter 3 (none) and, before `join`, 4.
void set_grads(std::vector<torch::Tensor>& a, std::vector<torch::Tensor>& b, int step, int join) {
  torch::manual_seed(1000 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    const bool none = i == 3 || (i == 4 && step < join);
    torch::Tensor g = none ? torch::Tensor() : torch::randn(a[i].sizes());
    a[i].mutable_grad() = g.defined() ? g.clone() : g;
    b[i].mutable_grad() = g.defined() ? g.clone() : g;
  }
}

// Equal bit for bit where `exact`, else to rounding (a few ulps over the steps taken).
bool same(const torch::Tensor& a, const torch::Tensor& b, bool exact) {
  return exact ? torch::equal(a, b) : torch::allclose(a, b, /*rtol=*/1e-6, /*atol=*/1e-7);
}

template <class Opt>
std::unique_ptr<torch::optim::Optimizer> make(std::vector<torch::Tensor>& ps, bool amsgrad) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1], ps[3]},
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-3).weight_decay(0.1).amsgrad(amsgrad)));
  groups.emplace_back(std::vector<torch::Tensor>{ps[2], ps[4]},
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0).betas({0.8, 0.95}).eps(1e-6)));
  return std::make_unique<Opt>(std::move(groups), torch::optim::AdamWOptions(1e-3));
}

void expect_identical(bool amsgrad) {
  auto ref = make_params(7);
  auto mine = clones(ref);
  auto a = make<torch::optim::AdamW>(ref, amsgrad);
  auto b = make<dtrain::optim::ForeachAdamW>(mine, amsgrad);
  for (int step = 0; step < 12; ++step) {
    set_grads(ref, mine, step, /*join=*/5);
    a->step();
    b->step();
  }
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(same(ref[i], mine[i], amsgrad)) << "parameter " << i;
  ASSERT_EQ(a->state().size(), b->state().size());
  for (size_t i : {0, 1, 2, 4}) {
    const auto& sa = static_cast<torch::optim::AdamWParamState&>(*a->state().at(key(*a, ref[i])));
    const auto& sb = static_cast<torch::optim::AdamWParamState&>(*b->state().at(key(*b, mine[i])));
    EXPECT_EQ(sa.step(), sb.step()) << i;
    EXPECT_TRUE(same(sa.exp_avg(), sb.exp_avg(), amsgrad)) << i;
    EXPECT_TRUE(same(sa.exp_avg_sq(), sb.exp_avg_sq(), amsgrad)) << i;
  }
  EXPECT_FALSE(b->state().count(key(*b, mine[3])));  // never had a gradient
}

}  // namespace

TEST(ForeachAdamW, EqualsLibtorchAdamWToRounding) { expect_identical(false); }

TEST(ForeachAdamW, AmsgradTakesLibtorchsPath) { expect_identical(true); }

// PyTorch's _multi_tensor_adamw (no amsgrad, not capturable), one tensor at a time.
TEST(ForeachAdamW, EqualsPyTorchsForeachArithmeticBitForBit) {
  auto ref = make_params(11);
  auto mine = clones(ref);
  const double lr = 3e-3, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  dtrain::optim::ForeachAdamW opt(mine, torch::optim::AdamWOptions(lr).weight_decay(wd).betas({b1, b2}).eps(eps));
  std::vector<torch::Tensor> m, v;
  for (const auto& p : ref) m.push_back(torch::zeros_like(p)), v.push_back(torch::zeros_like(p));
  for (int step = 1; step <= 6; ++step) {
    set_grads(ref, mine, step, /*join=*/0);
    opt.step();
    torch::NoGradGuard no_grad;
    const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
    for (size_t i = 0; i < ref.size(); ++i) {
      if (!ref[i].grad().defined()) continue;
      const auto& g = ref[i].grad();
      ref[i].mul_(1 - lr * wd);
      m[i].lerp_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      ref[i].addcdiv_(m[i], v[i].sqrt().div_(std::sqrt(bc2)).add_(eps), -lr / bc1);
    }
  }
  // (the moments too: a moment's last bit seldom shows in a parameter after a few steps)
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(torch::equal(ref[i], mine[i])) << "parameter " << i;
    if (i == 3) continue;  // (never had a gradient)
    const auto& st = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(key(opt, mine[i])));
    EXPECT_TRUE(torch::equal(m[i], st.exp_avg())) << "first moment " << i;
    EXPECT_TRUE(torch::equal(v[i], st.exp_avg_sq())) << "second moment " << i;
  }
}
