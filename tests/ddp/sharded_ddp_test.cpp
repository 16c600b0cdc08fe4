// ShardedDataParallel (ZeRO-2) + ShardedOptimizer against single-process training with the plain
// optimizer, one thread per rank over Gloo, W = 1, 2, 3.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/ddp/sharded_data_parallel.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

namespace {


using dtrain::testing::Net;
using dtrain::testing::max_rel_diff;
Net make_sdp_net(uint64_t seed, bool with_side = false) { return dtrain::testing::make_net(seed, with_side); }

std::pair<at::Tensor, at::Tensor> sdp_global_batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  auto x = at::randn({rows, 8}, gen);
  auto y = at::randn({rows, 4}, gen);
  return {x, y};
}


std::unique_ptr<torch::optim::Optimizer> make_opt(std::vector<torch::optim::OptimizerParamGroup> g, bool adamw) {
  if (adamw) return std::make_unique<torch::optim::AdamW>(std::move(g), torch::optim::AdamWOptions(1e-2));
  return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.05).momentum(0.9));
}

optim::ShardedOptimizer sharded_opt(Net& net, comm::ProcessGroup& pg, bool adamw) {
  return optim::ShardedOptimizer(net->parameters(), pg, [adamw](auto g) { return make_opt(std::move(g), adamw); });
}

// Small enough for several buckets (4 with this model), some owned by one rank only.
auto small_buckets() { return ddp::ShardedDataParallelOptions().bucket_cap_mb(0.001); }

struct Reference {
  std::vector<at::Tensor> params;      // after all steps
  std::vector<at::Tensor> first_grads;  // gradients of the first step
};

// One process, the plain optimizer, global batch of world * per_rank * micro rows per step.
Reference train_reference(int world, int per_rank, int steps, bool adamw, int micro = 1) {
  Net net = make_sdp_net(0);
  auto opt = make_opt({torch::optim::OptimizerParamGroup(net->parameters())}, adamw);
  Reference ref;
  for (int t = 0; t < steps; ++t) {
    opt->zero_grad();
    auto [x, y] = sdp_global_batch(t, world * per_rank * micro);
    at::mse_loss(net->forward(x), y).backward();
    if (t == 0) {
      for (auto& p : net->parameters()) ref.first_grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    }
    opt->step();
  }
  for (auto& p : net->parameters()) ref.params.push_back(p.detach().clone());
  return ref;
}

void expect_params_match(Net& net, const Reference& ref, int rank) {
  auto params = net->parameters();
  ASSERT_EQ(params.size(), ref.params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_LT(max_rel_diff(params[i], ref.params[i]), 1e-5) << "param " << i << " rank " << rank;
  }
}

// After a synchronized backward: owned gradients defined (and inside this rank's shards), the rest
// freed.
void expect_sharded_grads(ddp::ShardedDataParallel<Net>& model, const optim::ShardedOptimizer& opt, int rank) {
  const auto& reducer = model->state().reducer();
  auto inside_shards = [&](const at::Tensor& g) {
    for (const auto& b : reducer.buckets()) {
      if (b.shard.numel() == 0) continue;
      auto* lo = static_cast<const char*>(b.shard.data_ptr());
      auto* hi = lo + b.shard.numel() * b.shard.element_size();
      auto* p = static_cast<const char*>(g.data_ptr());
      if (p >= lo && p < hi) return true;
    }
    return false;
  };
  for (const auto& b : reducer.buckets()) {
    EXPECT_FALSE(b.bucket.buffer.defined()) << "transient bucket buffers are freed after backward";
    EXPECT_FALSE(b.scratch.defined());
  }
  const auto& params = opt.params();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) continue;
    if (opt.partition().owner[i] == rank) {
      ASSERT_TRUE(params[i].grad().defined()) << "owned param " << i << " rank " << rank;
      EXPECT_TRUE(inside_shards(params[i].grad())) << "param " << i << " rank " << rank;
    } else {
      EXPECT_FALSE(params[i].grad().defined()) << "param " << i << " owned by " << opt.partition().owner[i]
                                               << " has a gradient on rank " << rank;
    }
  }
}

}  // namespace

class ShardedDdpParity : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ShardedDdpParity, MatchesSingleProcessTraining) {
  const auto [W, adamw] = GetParam();
  const int B = 5, steps = 10;
  const Reference ref = train_reference(W, B, steps, adamw);
  run_ranks(W, [&, W = W, adamw = adamw](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net = make_sdp_net(r);  // ranks start apart: the construction broadcast must align them
    auto opt = sharded_opt(net, pg, adamw);
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt, small_buckets());
    const auto& reducer = model->state().reducer();
    EXPECT_GE(reducer.buckets().size(), 4u);
    int64_t owned = 0;  // trainable elements owned (the partition counts the frozen one too)
    for (size_t i = 0; i < opt.params().size(); ++i) {
      if (opt.params()[i].requires_grad() && opt.partition().owner[i] == r) owned += opt.params()[i].numel();
    }
    EXPECT_EQ(reducer.owned_elements(), owned);
    if (W == 3) {
      bool some_zero = false;  // a bucket with nothing for some rank: zero counts in the reduce-scatter
      for (const auto& b : reducer.buckets()) some_zero = some_zero || *std::min_element(b.counts.begin(), b.counts.end()) == 0;
      EXPECT_TRUE(some_zero);
    }
    for (int t = 0; t < steps; ++t) {
      opt.zero_grad();
      auto [x, y] = sdp_global_batch(t, W * B);
      at::mse_loss(model->forward(x.narrow(0, r * B, B)), y.narrow(0, r * B, B)).backward();
      expect_sharded_grads(model, opt, r);
      if (t == 0) {
        const auto& params = opt.params();
        for (size_t i = 0; i < params.size(); ++i) {
          if (params[i].grad().defined()) {
            EXPECT_LT(max_rel_diff(params[i].grad(), ref.first_grads[i]), 1e-5) << "grad " << i << " rank " << r;
          }
        }
      }
      opt.step();
    }
    expect_params_match(net, ref, r);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndOptimizers, ShardedDdpParity,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_AdamW" : "_SgdMomentum");
                         });

class ShardedDdpAccumulation : public ::testing::TestWithParam<int> {};

// Two micro-batches per step, the first under no_sync (full local gradients, no communication):
// equal to one process with the whole batch (each micro-batch loss scaled by 1/2).
TEST_P(ShardedDdpAccumulation, NoSyncMatchesReference) {
  const int W = GetParam();
  const int B = 3, steps = 6, micro = 2;
  const Reference ref = train_reference(W, B, steps, /*adamw=*/false, micro);
  run_ranks(W, [&](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net = make_sdp_net(r);
    auto opt = sharded_opt(net, pg, /*adamw=*/false);
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt, small_buckets());
    for (int t = 0; t < steps; ++t) {
      opt.zero_grad();
      auto [x, y] = sdp_global_batch(t, W * B * micro);
      for (int m = 0; m < micro; ++m) {
        auto xs = x.narrow(0, (m * W + r) * B, B);
        auto ys = y.narrow(0, (m * W + r) * B, B);
        if (m + 1 < micro) {
          auto guard = model->no_sync();
          (at::mse_loss(model->forward(xs), ys) / micro).backward();
          for (auto& p : net->parameters()) {
            if (p.requires_grad()) EXPECT_TRUE(p.grad().defined()) << "no_sync keeps full local gradients";
          }
        } else {
          (at::mse_loss(model->forward(xs), ys) / micro).backward();
          expect_sharded_grads(model, opt, r);
        }
      }
      opt.step();
    }
    expect_params_match(net, ref, r);
  });
}

// Two synchronized backwards without zeroing in between: the second average is added to the first
// (the owned gradient carries the earlier reduction), as with DDP.
TEST_P(ShardedDdpAccumulation, SyncedAccumulationMatchesReference) {
  const int W = GetParam();
  const int B = 3, steps = 6, micro = 2;
  const Reference ref = train_reference(W, B, steps, /*adamw=*/true, micro);
  run_ranks(W, [&](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net = make_sdp_net(r);
    auto opt = sharded_opt(net, pg, /*adamw=*/true);
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt, small_buckets());
    for (int t = 0; t < steps; ++t) {
      opt.zero_grad();
      auto [x, y] = sdp_global_batch(t, W * B * micro);
      for (int m = 0; m < micro; ++m) {
        auto xs = x.narrow(0, (m * W + r) * B, B);
        auto ys = y.narrow(0, (m * W + r) * B, B);
        (at::mse_loss(model->forward(xs), ys) / micro).backward();
        expect_sharded_grads(model, opt, r);
      }
      opt.step();
    }
    expect_params_match(net, ref, r);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShardedDdpAccumulation, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

// Owners come from the optimizer, matched by identity: param groups in another order than the
// module's registration give the same training.
TEST(ShardedDdp, OptimizerParamGroupsInAnyOrder) {
  const int W = 2, B = 4, steps = 4;
  const Reference ref = train_reference(W, B, steps, /*adamw=*/false);
  run_ranks(W, [&](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net = make_sdp_net(0);
    std::vector<at::Tensor> late = net->fc3->parameters(), early;
    for (auto& p : net->fc2->parameters()) late.push_back(p);
    for (auto& p : net->fc1->parameters()) early.push_back(p);
    early.push_back(net->frozen);
    std::vector<torch::optim::OptimizerParamGroup> groups{torch::optim::OptimizerParamGroup(late),
                                                          torch::optim::OptimizerParamGroup(early)};
    optim::ShardedOptimizer opt(std::move(groups), pg, [](auto g) { return make_opt(std::move(g), false); });
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt, small_buckets());
    for (int t = 0; t < steps; ++t) {
      opt.zero_grad();
      auto [x, y] = sdp_global_batch(t, W * B);
      at::mse_loss(model->forward(x.narrow(0, r * B, B)), y.narrow(0, r * B, B)).backward();
      expect_sharded_grads(model, opt, r);
      opt.step();
    }
    expect_params_match(net, ref, r);
  });
}

// The full-size gradient of a parameter owned elsewhere lives only until it is copied into its
// bucket: by the time backward reaches the first layer, the later layers' non-owned gradients are
// gone already.
TEST(ShardedDdp, NonOwnedGradientsAreFreedDuringBackward) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Net net = make_sdp_net(0);
    auto opt = sharded_opt(net, pg, true);
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt, small_buckets());
    std::vector<std::pair<at::Tensor, bool>> later;  // fc2 and fc3 parameters: (param, owned here)
    for (size_t i = 0; i < opt.params().size(); ++i) {
      const auto& p = opt.params()[i];
      for (auto& q : net->fc2->parameters()) if (q.is_same(p)) later.emplace_back(p, opt.partition().owner[i] == r);
      for (auto& q : net->fc3->parameters()) if (q.is_same(p)) later.emplace_back(p, opt.partition().owner[i] == r);
    }
    ASSERT_EQ(later.size(), 4u);
    int checked = 0;
    auto handle = net->fc1->weight.register_hook([&](const at::Tensor&) {
      ++checked;
      for (const auto& [p, owned] : later) {
        if (!owned) EXPECT_FALSE(p.grad().defined()) << "rank " << r;
      }
    });
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      model->forward(at::ones({2, 8}) * (r + 1)).sum().backward();
      expect_sharded_grads(model, opt, r);
      opt.step();
    }
    net->fc1->weight.remove_hook(handle);
    EXPECT_EQ(checked, 2);
  });
}

TEST(ShardedDdp, UnusedParameterIsAClearError) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Net net = make_sdp_net(0, /*with_side=*/true);
    auto opt = sharded_opt(net, pg, true);
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt);
    try {
      model->forward(at::ones({2, 8}), /*use_side=*/false).sum().backward();
    } catch (const std::exception& e) {
      errors[pg.rank()] = e.what();
    }
    // The wrapper stays usable: a backward that reaches every parameter works.
    opt.zero_grad();
    model->forward(at::ones({2, 8}), /*use_side=*/true).sum().backward();
    expect_sharded_grads(model, opt, pg.rank());
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("got no gradient: module.side.weight, module.side.bias"), std::string::npos) << e;
    EXPECT_NE(e.find("requires_grad false"), std::string::npos) << e;
  }
}

TEST(ShardedDdp, OptimizerMustHoldExactlyTheModulesParameters) {
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Net net = make_sdp_net(0);
    // Missing fc1: named.
    std::vector<at::Tensor> some;
    for (auto& p : net->fc2->parameters()) some.push_back(p);
    for (auto& p : net->fc3->parameters()) some.push_back(p);
    optim::ShardedOptimizer partial(some, pg, [](auto g) { return make_opt(std::move(g), true); });
    try {
      ddp::ShardedDataParallel<Net>(net, pg, partial);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("not in the optimizer: module.fc1.weight, module.fc1.bias"),
                std::string::npos)
          << e.what();
    }
    // An extra parameter the module does not have.
    auto params = net->parameters();
    params.push_back(at::zeros({3}).requires_grad_());
    optim::ShardedOptimizer extra(params, pg, [](auto g) { return make_opt(std::move(g), true); });
    try {
      ddp::ShardedDataParallel<Net>(net, pg, extra);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("1 trainable parameter(s) that are not in the wrapped module"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(ShardedDdp, NoSyncCommunicatesNothingAndBuffersComeFromRankZero) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    Net net = make_sdp_net(pg.rank() + 5);
    net->steps.fill_(100 * pg.rank());
    auto opt = sharded_opt(net, pg, false);
    auto model = ddp::ShardedDataParallel<Net>(net, pg, opt);
    Net ref = make_sdp_net(5);
    EXPECT_TRUE(at::equal(net->fc1->weight, ref->fc1->weight));
    EXPECT_TRUE(model->named_parameters().contains("module.fc1.weight"));
    auto x = at::full({2, 8}, pg.rank() + 1.0);
    {
      auto guard = model->no_sync();
      model->forward(x).sum().backward();
    }
    EXPECT_EQ(net->steps.item<float>(), 1.0f);  // rank 0's 0, broadcast, +1
    // Different data per rank under no_sync: every gradient local and full (so they differ).
    auto g = net->fc1->weight.grad().clone();
    auto all = at::empty({2 * g.numel()});
    comm::all_gather(pg, all, g.reshape({-1}));
    EXPECT_FALSE(at::allclose(all.narrow(0, 0, g.numel()), all.narrow(0, g.numel(), g.numel())));
  });
}
