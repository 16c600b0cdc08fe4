// dtrain::nn::HookedImpl / Hooked / make_hookable (Design note [hooked modules]): stock layers and
// a user's own modules get forward hooks with no renamed parameter and the same results.
#include "dtrain/nn/hooked.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/recompute/checkpoint.h"
#include "testing/testing.h"

namespace {

using dtrain::nn::Hooked;
using dtrain::nn::HookOrder;
using dtrain::nn::Tensors;

std::vector<std::string> names_of(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

// A user's module with two tensor arguments, a non-tensor one, and two outputs.
struct PairImpl : torch::nn::Module {
  PairImpl() { w = register_parameter("w", at::linspace(0.5, 1.5, 4)); }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& a, double scale, at::Tensor b) {
    auto h = at::tanh(a * w * scale);
    return {h + b, at::dropout(h, 0.5, is_training()) * b};
  }
  at::Tensor w;
};
TORCH_MODULE(Pair);

// Counts the calls through the hooks of `m` and returns the hook's id.
uint64_t count_calls(dtrain::nn::Hookable& m, int& calls) {
  return m.forward_hooks().add(HookOrder::User, [&calls](const Tensors& in, const dtrain::nn::ForwardBody& next) {
    ++calls;
    return next(in);
  });
}

}  // namespace

TEST(Hooked, HolderKeepsNamesAndResults) {
  torch::manual_seed(1);
  torch::nn::Linear plain(3, 4);
  torch::manual_seed(1);
  Hooked<torch::nn::Linear> hooked(3, 4);
  EXPECT_EQ(names_of(*hooked), names_of(*plain));
  auto x = at::randn({2, 3});
  EXPECT_TRUE(at::equal(hooked(x), plain(x)));
  int calls = 0;
  count_calls(*hooked, calls);
  EXPECT_TRUE(at::equal(hooked->forward(x), plain(x)));
  EXPECT_EQ(calls, 1);
  // clone() is a HookedImpl again, with its own tensors and no hooks.
  auto copy = std::dynamic_pointer_cast<dtrain::nn::HookedImpl<torch::nn::LinearImpl>>(hooked->clone());
  ASSERT_TRUE(copy);
  EXPECT_NE(copy->weight.data_ptr(), hooked->weight.data_ptr());
  EXPECT_EQ(copy->forward_hooks().size(), 0u);
}

TEST(Hooked, SequentialChildrenAreUpgradedInPlace) {
  torch::manual_seed(2);
  torch::nn::Sequential seq(torch::nn::Linear(3, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2));
  const auto names = names_of(*seq);
  auto x = at::randn({4, 3});
  const auto before = seq->forward(x);
  const at::Tensor weight = seq->ptr(0)->named_parameters()["weight"];
  auto& hooked = dtrain::nn::make_hookable(*seq, "0", *seq->ptr(0), "0");
  auto* h = dynamic_cast<dtrain::nn::Hookable*>(&hooked);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(seq->ptr(0).get(), &hooked) << "the Sequential runs the upgraded child";
  EXPECT_EQ(seq->named_children()["0"].get(), &hooked) << "and registers it under the same key";
  EXPECT_EQ(names_of(*seq), names);
  EXPECT_EQ(seq->ptr(0)->named_parameters()["weight"].unsafeGetTensorImpl(), weight.unsafeGetTensorImpl())
      << "the upgraded child shares the parameters";
  int calls = 0;
  count_calls(*h, calls);
  EXPECT_TRUE(at::equal(seq->forward(x), before));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(&dtrain::nn::make_hookable(*seq, "0", hooked, "0"), &hooked) << "already hookable: unchanged";
  // The clone of the Sequential keeps working (HookedImpl::clone keeps the type AnyModule needs).
  auto clone = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
  ASSERT_TRUE(clone);
  EXPECT_TRUE(at::allclose(clone->forward(x), before));
}

TEST(Hooked, TheEntryNamedByTheKeyIsUpgraded) {
  torch::nn::Linear shared(3, 3);
  torch::nn::Sequential seq(shared, torch::nn::Tanh(), shared);  // one module at positions 0 and 2
  auto& hooked = dtrain::nn::make_hookable(*seq, "2", *seq->ptr(2), "2");
  EXPECT_EQ(seq->ptr(2).get(), &hooked);
  EXPECT_EQ(seq->named_children()["2"].get(), &hooked);
  EXPECT_EQ(seq->ptr(0).get(), shared.ptr().get()) << "position 0 untouched";
}

TEST(Hooked, ClearErrorsForWhatCannotBeHooked) {
  struct NetImpl : torch::nn::Module {
    NetImpl() { fc = register_module("fc", torch::nn::Linear(2, 2)); }
    torch::nn::Linear fc{nullptr};
  };
  NetImpl net;
  try {
    dtrain::nn::make_hookable(net, "fc", *net.fc, "fc");
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("fc (torch::nn::LinearImpl)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dtrain::nn::Hooked<torch::nn::Linear> fc{nullptr}"), std::string::npos) << msg;
  }
  torch::nn::Sequential seq{Pair()};
  try {
    dtrain::nn::make_hookable(*seq, "0", *seq->ptr(0), "0");
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("register_hookable<"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(dtrain::nn::can_be_hooked(*seq->ptr(0)));
  dtrain::nn::register_hookable<PairImpl>();
  EXPECT_TRUE(dtrain::nn::can_be_hooked(*seq->ptr(0)));
}

TEST(Hooked, ManyArgumentsAndOutputsUnderRecomputation) {
  // Recomputation replays the body in backward, after forward returned: the non-tensor argument
  // and the dropout mask must be the forward's. Gradients equal the plain module's.
  auto a = at::randn({3, 4}).requires_grad_(true);
  auto b = at::randn({3, 4}).requires_grad_(true);
  Pair plain;
  Hooked<Pair> hooked(std::make_shared<dtrain::nn::HookedImpl<PairImpl>>(*plain));  // shares plain's parameter
  dtrain::recompute::checkpoint_forward(*hooked);
  auto grads = [&](auto& m) {
    torch::manual_seed(7);
    auto [p, q] = m->forward(a, 0.7, b);
    (p.sum() + (q * q).sum()).backward();
    std::vector<at::Tensor> g{a.grad().clone(), b.grad().clone(), plain->w.grad().clone()};
    a.grad().zero_();
    b.grad().zero_();
    plain->w.grad().zero_();
    return g;
  };
  const auto want = grads(plain);
  const auto got = grads(hooked);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::allclose(got[i], want[i], 1e-6, 1e-7)) << i;
}

TEST(Hooked, CheckpointModulesOnASequentialKeepsGradients) {
  torch::manual_seed(3);
  torch::nn::Sequential ref(torch::nn::Linear(3, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                            torch::nn::Linear(8, 1));
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(ref->clone());
  const int64_t n = dtrain::recompute::checkpoint_modules(*seq, dtrain::recompute::of_type<torch::nn::LinearImpl>());
  EXPECT_EQ(n, 3);
  EXPECT_EQ(names_of(*seq), names_of(*ref));
  auto x = at::randn({5, 3});
  ref->forward(x).pow(2).sum().backward();
  seq->forward(x).pow(2).sum().backward();
  auto pr = ref->named_parameters(), ps = seq->named_parameters();
  for (const auto& it : pr) {
    EXPECT_TRUE(at::allclose(ps[it.key()].grad(), it.value().grad(), 1e-6, 1e-7)) << it.key();
  }
  try {
    dtrain::recompute::checkpoint_modules(*seq, dtrain::recompute::of_type<torch::nn::Conv2dImpl>());
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("selected no module"), std::string::npos) << e.what();
  }
}
