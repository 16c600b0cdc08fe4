// ZeRO-1 (ShardedOptimizer) with DDP against the plain optimizer in one process, W = 1, 2, 3.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

namespace {


using dtrain::testing::Mlp;
Mlp make_zero_mlp() { return dtrain::testing::make_mlp(3); }

std::pair<at::Tensor, at::Tensor> zero_batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
  return {at::randn({rows, 6}, gen), at::randn({rows, 3}, gen)};
}

// Two param groups (the first layer with its own learning rate), halved at step 5.
std::vector<torch::optim::OptimizerParamGroup> zero_groups_of(Mlp& m, bool adamw) {
  std::vector<at::Tensor> first = m->a->parameters(), rest;
  for (auto& p : m->b->parameters()) rest.push_back(p);
  for (auto& p : m->c->parameters()) rest.push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> g;
  if (adamw) {
    g.emplace_back(first, std::make_unique<torch::optim::AdamWOptions>(5e-3));
  } else {
    g.emplace_back(first, std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.02).momentum(0.9)));
  }
  g.emplace_back(rest);
  return g;
}

std::unique_ptr<torch::optim::Optimizer> make_zero_opt(std::vector<torch::optim::OptimizerParamGroup> g, bool adamw) {
  if (adamw) return std::make_unique<torch::optim::AdamW>(std::move(g), torch::optim::AdamWOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.05).momentum(0.9));
}

void halve_lr(torch::optim::OptimizerOptions& o, bool adamw) {
  if (adamw) {
    auto& a = static_cast<torch::optim::AdamWOptions&>(o);
    a.lr(a.lr() / 2);
  } else {
    auto& s = static_cast<torch::optim::SGDOptions&>(o);
    s.lr(s.lr() / 2);
  }
}

constexpr int kZeroSteps = 10, kZeroB = 4;

}  // namespace

class ShardedOptimizerParity : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ShardedOptimizerParity, MatchesThePlainOptimizer) {
  const auto [W, adamw] = GetParam();
  Mlp ref = make_zero_mlp();
  auto plain = make_zero_opt(zero_groups_of(ref, adamw), adamw);
  for (int t = 0; t < kZeroSteps; ++t) {
    if (t == 5) {
      for (auto& g : plain->param_groups()) halve_lr(g.options(), adamw);
    }
    plain->zero_grad();
    auto [x, y] = zero_batch(t, W * kZeroB);
    at::mse_loss(ref->forward(x), y).backward();
    plain->step();
  }
  run_ranks(W, [&, W = W, adamw = adamw](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Mlp net = make_zero_mlp();
    auto model = ddp::DistributedDataParallel<Mlp>(net, pg);
    optim::ShardedOptimizer opt(zero_groups_of(net, adamw), pg, [adamw = adamw](auto g) { return make_zero_opt(std::move(g), adamw); });
    EXPECT_EQ(opt.num_groups(), 2u);
    for (int t = 0; t < kZeroSteps; ++t) {
      if (t == 5) {
        for (size_t g = 0; g < opt.num_groups(); ++g) halve_lr(opt.group_options(g), adamw);
      }
      opt.zero_grad();
      auto [x, y] = zero_batch(t, W * kZeroB);
      at::mse_loss(model->forward(x.narrow(0, r * kZeroB, kZeroB)), y.narrow(0, r * kZeroB, kZeroB)).backward();
      opt.step();
    }
    auto mine = net->parameters();
    auto expect = ref->parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      auto rel = ((mine[i] - expect[i]).abs().max() / expect[i].abs().max()).item<double>();
      EXPECT_LT(rel, 1e-5) << "param " << i << " rank " << r;
    }
    // Optimizer state only for the owned parameters.
    int64_t with_state = 0;
    for (const auto& kv : opt.local().state()) (void)kv, ++with_state;
    EXPECT_EQ(with_state, static_cast<int64_t>(opt.partition().by_rank[r].size()));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndOptimizers, ShardedOptimizerParity,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_AdamW" : "_SgdMomentum");
                         });

// ZeRO-1 per rank, before the broadcast: the rank's own optimizer changes the parameters it owns
// and no other (the broadcast that follows would hide a rank that steps everything: the weights
// still match, the work and the state are W times too much). An optimizer that records the
// parameters right after its step sees it; each rank's gradients differ, so the broadcast's result
// shows whose step each parameter took. Fails if the local optimizer is given (or steps) all.
namespace {
struct RecordingSgd : torch::optim::SGD {
  std::vector<at::Tensor> watched;  // every parameter of the model
  std::vector<at::Tensor>* after_step;
  RecordingSgd(std::vector<torch::optim::OptimizerParamGroup> g, std::vector<at::Tensor> all, std::vector<at::Tensor>* out)
      : torch::optim::SGD(std::move(g), torch::optim::SGDOptions(1.0)), watched(std::move(all)), after_step(out) {}
  at::Tensor step(LossClosure closure = nullptr) override {
    at::Tensor loss = torch::optim::SGD::step(std::move(closure));
    after_step->clear();
    for (const auto& p : watched) after_step->push_back(p.detach().clone());
    return loss;
  }
};
}  // namespace

TEST(ZeroOne, StepsOnlyWhatItOwns) {
  run_ranks(3, [](comm::ProcessGroup& pg) {
    Mlp m = make_zero_mlp();
    const std::vector<at::Tensor> params = m->parameters();
    std::vector<at::Tensor> before, after_local;
    for (const auto& p : params) before.push_back(p.detach().clone());
    optim::ShardedOptimizer opt(params, pg, [&](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_unique<RecordingSgd>(std::move(g), params, &after_local);
    });
    const float mine = static_cast<float>(pg.rank() + 1);  // rank r's gradient: r + 1 everywhere
    for (const auto& p : params) p.mutable_grad() = at::full_like(p, mine);
    opt.step();
    const auto& owner_of = opt.partition().by_rank;
    std::vector<int> owner(params.size(), -1);
    for (int r = 0; r < pg.size(); ++r) {
      for (size_t i : owner_of[static_cast<size_t>(r)]) owner[i] = r;
    }
    ASSERT_EQ(after_local.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_GE(owner[i], 0) << "parameter " << i << " has no owner";
      const bool owned = owner[i] == pg.rank();
      // Before the broadcast: owned ones stepped with this rank's gradient, the rest untouched.
      EXPECT_TRUE(at::equal(after_local[i], owned ? before[i] - mine : before[i]))
          << "rank " << pg.rank() << ", parameter " << i << (owned ? " (owned) was not stepped" : " (not owned) changed");
      // After: every parameter is its owner's step.
      EXPECT_TRUE(at::allclose(params[i], before[i] - static_cast<float>(owner[i] + 1))) << "parameter " << i;
    }
  });
}

TEST(Partition, GreedyBalancesBySize) {
  std::vector<at::Tensor> ps{at::empty({10}), at::empty({100}), at::empty({60}), at::empty({50}), at::empty({5})};
  auto p = optim::partition_greedy(ps, 2);
  // Largest first: 100 -> r0, 60 -> r1, 50 -> r1 (110), 10 -> r0 (110), 5 -> r0 (115).
  EXPECT_EQ(p.owner, (std::vector<int>{0, 0, 1, 1, 0}));
  EXPECT_EQ(p.elements, (std::vector<int64_t>{115, 110}));
  EXPECT_EQ(p.by_rank[1], (std::vector<size_t>{2, 3}));
  auto one = optim::partition_greedy(ps, 1);
  EXPECT_EQ(one.elements, (std::vector<int64_t>{225}));
  EXPECT_THROW(optim::partition_greedy(ps, 0), c10::Error);
}
