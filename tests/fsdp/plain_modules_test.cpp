// FSDP units in models that know nothing of dtrain (Design note [hooked modules]): the Linear
// layers of a torch::nn::Sequential, and a user's module whose members are declared
// dtrain::nn::Hooked<...>, train like one process at W = 1, 2, 3 (3: uneven shards), with the
// plain model's parameter names; what cannot be a unit is a clear error.
#include <gtest/gtest.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include "dtrain/nn/hooked.h"
#include "dtrain/recompute/checkpoint.h"
#include "fsdp_testing.h"

namespace {

using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;

torch::nn::Sequential make_seq(uint64_t seed) {
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 3));
}

// A user's model: two members declared Hooked (one line each), one plain.
struct UserNetImpl : torch::nn::Module {
  UserNetImpl() {
    fc1 = register_module("fc1", decltype(fc1)(6, 16));
    fc2 = register_module("fc2", decltype(fc2)(16, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(at::tanh(fc2(at::tanh(fc1(x))))); }
  dtrain::nn::Hooked<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(UserNet);

UserNet make_user(uint64_t seed) {
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  torch::manual_seed(seed);
  return UserNet();
}

struct PlainNetImpl : torch::nn::Module {
  PlainNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(PlainNet);

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

class FsdpPlainModules : public ::testing::TestWithParam<int> {};

TEST_P(FsdpPlainModules, SequentialLinearsAreUnits) {
  const int world = GetParam();
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.per_rank = 3;
  const Reference ref = train_reference(make_seq(11), spec, world);
  for (bool recompute : {false, true}) {
    run_ranks(world, [&](dtrain::comm::ProcessGroup& pg) {
      auto seq = make_seq(11);
      if (recompute) dtrain::recompute::checkpoint_modules(*seq, dtrain::recompute::of_type<torch::nn::LinearImpl>());
      auto model = dtrain::fsdp::FullyShardedDataParallel<torch::nn::Sequential>(
          seq, pg, dtrain::fsdp::FullyShardedOptions().wrap_policy(dtrain::fsdp::WrapPolicy::by_type<torch::nn::LinearImpl>()));
      EXPECT_EQ(model->state().units().size(), 4u) << "the root and three Linear layers";
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), world);
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, recompute ? "sequential+recompute" : "sequential");
    });
  }
}

TEST_P(FsdpPlainModules, HookedMembersAreUnits) {
  const int world = GetParam();
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.per_rank = 3;
  const Reference ref = train_reference(make_user(12), spec, world);
  run_ranks(world, [&](dtrain::comm::ProcessGroup& pg) {
    auto model = dtrain::fsdp::FullyShardedDataParallel<UserNet>(
        make_user(12), pg, dtrain::fsdp::FullyShardedOptions().wrap_policy(dtrain::fsdp::WrapPolicy::by_size(1)));
    EXPECT_EQ(model->state().units().size(), 3u) << "the root (head) and fc1, fc2";
    auto opt = make_opt(spec, model->parameters());
    train(model, *opt, spec, pg.rank(), world);
    auto dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, "hooked members");
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, FsdpPlainModules, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(FsdpPlainModuleErrors, WhatCannotBeAUnitIsNamed) {
  run_ranks(1, [&](dtrain::comm::ProcessGroup& pg) {
    // A plain member picked by type: named, with what to change.
    std::string msg = error_of([&] {
      dtrain::fsdp::FullyShardedDataParallel<PlainNet>(
          PlainNet(), pg,
          dtrain::fsdp::FullyShardedOptions().wrap_policy(dtrain::fsdp::WrapPolicy::by_type<torch::nn::LinearImpl>()));
    });
    EXPECT_NE(msg.find("the wrap policy picked fc2 (torch::nn::LinearImpl)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dtrain::nn::Hooked<"), std::string::npos) << msg;
    // by_size passes over what cannot be a unit: on this model that is everything, an error too.
    msg = error_of([&] {
      dtrain::fsdp::FullyShardedDataParallel<PlainNet>(
          PlainNet(), pg, dtrain::fsdp::FullyShardedOptions().wrap_policy(dtrain::fsdp::WrapPolicy::by_size(1)));
    });
    EXPECT_NE(msg.find("picked no module"), std::string::npos) << msg;
    // A size no module reaches (a policy that wraps nothing): the same error, not one silent unit.
    msg = error_of([&] {
      dtrain::fsdp::FullyShardedDataParallel<NestedNet>(
          make_nested(1), pg, dtrain::fsdp::FullyShardedOptions().wrap_policy(dtrain::fsdp::WrapPolicy::by_size(1000000)));
    });
    EXPECT_NE(msg.find("picked no module"), std::string::npos) << msg;
    msg = error_of([&] {
      dtrain::fsdp::FullyShardedDataParallel<PlainNet>(
          PlainNet(), pg,
          dtrain::fsdp::FullyShardedOptions().wrap_policy(dtrain::fsdp::WrapPolicy::by_type<torch::nn::Conv2dImpl>()));
    });
    EXPECT_NE(msg.find("picked no module"), std::string::npos) << msg;
  });
}

TEST(FsdpUnitState, TransitionsAreChecked) {
  // A unit without parameters walks the state machine through its own calls, each checked.
  dtrain::fsdp::Unit u;
  u.name = "blocks.0";
  u.expected_grads = 1;
  using S = dtrain::fsdp::Unit::State;
  EXPECT_EQ(u.pre_forward(), 0);
  EXPECT_EQ(u.state(), S::Forward);
  EXPECT_FALSE(u.post_forward({}));  // no output requires grad: no backward follows
  EXPECT_EQ(u.state(), S::Forwarded);
  u.pre_backward();
  EXPECT_EQ(u.state(), S::BackwardPre);
  EXPECT_TRUE(u.in_backward());
  EXPECT_NE(error_of([&] { u.pre_backward(); }).find("its backward started twice"), std::string::npos);
  EXPECT_TRUE(u.grad_ready());
  EXPECT_EQ(u.post_backward(/*reduce=*/true), 0);
  EXPECT_EQ(u.state(), S::Reduced);
  EXPECT_EQ(u.post_backward(true), 0);  // already Reduced: nothing
  const std::string msg = error_of([&] { u.pre_forward(); });
  EXPECT_NE(msg.find("FSDP unit 'blocks.0': no transition from Reduced to Forward"), std::string::npos) << msg;
  u.reset();
  EXPECT_EQ(u.state(), S::Idle);
  EXPECT_NE(error_of([&] { u.post_forward({}); }).find("from Idle to Forwarded"), std::string::npos);
  EXPECT_EQ(u.state(), S::Idle);
}
