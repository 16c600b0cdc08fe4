// GradScaler: every rank skips together on inf/NaN and backs off; good steps grow the scale; with a
// power-of-two scale, scaled training equals unscaled fp32 training. Sharded gradients (ZeRO-2,
// FSDP) agree on inf/NaN across ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/amp/grad_scaler.h"
#include "dtrain/comm.h"
#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/ddp/sharded_data_parallel.h"
#include "dtrain/fsdp/fully_sharded_data_parallel.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;

namespace {
torch::nn::Linear make_linear() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(9);
  return torch::nn::Linear(4, 2);
}
}  // namespace

TEST(GradScaler, OverflowOnOneRankMakesEveryRankSkipAndBackOff) {
  dtrain::testing::run_ranks(3, [](comm::ProcessGroup& pg) {
    auto lin = make_linear();
    torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.1));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1024), pg);
    auto before = lin->weight.clone();
    scaler.scale(lin->forward(at::ones({2, 4})).sum()).backward();
    if (pg.rank() == 1) lin->weight.grad()[0][0] = std::numeric_limits<float>::infinity();  // only rank 1 overflows
    bool stepped = scaler.step([&] { opt.step(); }, lin->parameters());
    scaler.update();
    EXPECT_FALSE(stepped) << "rank " << pg.rank();
    EXPECT_TRUE(at::equal(lin->weight, before));
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(scaler.state().growth_tracker, 0);
  });
}

TEST(GradScaler, GoodStepsGrowTheScale) {
  auto lin = make_linear();
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.01));
  amp::GradScaler scaler(amp::GradScalerOptions().init_scale(8).growth_interval(3));
  for (int t = 0; t < 7; ++t) {
    opt.zero_grad();
    scaler.scale(lin->forward(at::ones({2, 4})).sum()).backward();
    EXPECT_TRUE(scaler.step([&] { opt.step(); }, lin->parameters()));
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 32.0);  // grew after steps 3 and 6
  EXPECT_EQ(scaler.state().growth_tracker, 1);
}

TEST(GradScaler, ScaledTrainingEqualsUnscaledUnderDdp) {
  const int W = 2, B = 3;
  auto data = [](int t) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(40 + t);
    return std::make_pair(at::randn({W * B, 4}, g), at::randn({W * B, 2}, g));
  };
  auto ref = make_linear();
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int t = 0; t < 6; ++t) {
    ref_opt.zero_grad();
    auto [x, y] = data(t);
    at::mse_loss(ref->forward(x), y).backward();
    ref_opt.step();
  }
  dtrain::testing::run_ranks(W, [&](comm::ProcessGroup& pg) {
    auto model = ddp::DistributedDataParallel<torch::nn::Linear>(make_linear(), pg);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(1 << 12).growth_interval(2), pg);
    for (int t = 0; t < 6; ++t) {
      opt.zero_grad();
      auto [x, y] = data(t);
      auto loss = at::mse_loss(model->forward(x.narrow(0, pg.rank() * B, B)), y.narrow(0, pg.rank() * B, B));
      scaler.scale(loss).backward();
      scaler.unscale(model->parameters());
      EXPECT_TRUE(scaler.step([&] { opt.step(); }, model->parameters()));
      scaler.update();
    }
    EXPECT_EQ(scaler.get_scale(), std::pow(2.0, 12 + 3));
    auto mine = model->module()->parameters();
    auto expect = ref->parameters();
    for (size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(at::allclose(mine[i], expect[i], 1e-6, 1e-7)) << i;
  });
}

TEST(GradScaler, MisuseAndBadStateAreClearErrors) {
  auto lin = make_linear();
  amp::GradScaler scaler(amp::GradScalerOptions().growth_interval(10));
  scaler.scale(lin->forward(at::ones({1, 4})).sum()).backward();
  scaler.unscale(lin->parameters());
  EXPECT_THROW(scaler.unscale(lin->parameters()), c10::Error);
  EXPECT_THROW(scaler.update(), c10::Error);
  EXPECT_THROW(scaler.load_state({-1.0, 0}), c10::Error);
  EXPECT_THROW(scaler.load_state({2.0, 10}), c10::Error);
  scaler.load_state({128.0, 3});
  EXPECT_EQ(scaler.get_scale(), 128.0);
  EXPECT_THROW(amp::GradScaler(amp::GradScalerOptions().backoff_factor(1.5)), c10::Error);
}

TEST(GradScaler, ShardedGradientsUnderZero2SkipTogether) {
  // ZeRO-2: each rank holds only its own gradient shards; an overflow in one rank's shard must
  // make every rank skip the step (and no rank's parameters change).
  dtrain::testing::run_ranks(3, [](comm::ProcessGroup& pg) {
    auto net = dtrain::testing::make_mlp(4);
    optim::ShardedOptimizer opt(net->parameters(), pg, [](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.1));
    });
    auto model = ddp::ShardedDataParallel<dtrain::testing::Mlp>(net, pg, opt);
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256), pg);
    std::vector<at::Tensor> before;
    for (auto& p : net->parameters()) before.push_back(p.detach().clone());
    scaler.scale(model->forward(at::ones({2, 6})).sum()).backward();
    std::vector<at::Tensor> owned;
    for (auto& p : net->parameters()) {
      if (p.grad().defined()) owned.push_back(p);
    }
    ASSERT_FALSE(owned.empty());
    if (pg.rank() == 2) owned.front().grad().view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
    scaler.unscale(owned);
    EXPECT_FALSE(scaler.step([&] { opt.step(); }, owned)) << "rank " << pg.rank();
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 128.0);
    auto after = net->parameters();
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << i;
  });
}

TEST(GradScaler, FsdpShardsSkipTogether) {
  // FSDP: each rank holds one chunk of every unit's flat gradient; NaN in one rank's chunk must make
  // every rank skip the step (shards unchanged) and back off; a clean step afterwards steps all.
  dtrain::testing::run_ranks(3, [](comm::ProcessGroup pg) {
    auto net = dtrain::testing::make_mlp(5);
    auto model = fsdp::FullyShardedDataParallel<dtrain::testing::Mlp>(net, pg);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(256), pg);
    auto shards = model->parameters();
    std::vector<at::Tensor> before;
    for (auto& s : shards) before.push_back(s.detach().clone());
    scaler.scale(model->forward(at::ones({2, 6})).sum()).backward();
    ASSERT_TRUE(shards[0].grad().defined());
    if (pg.rank() == 1) shards[0].grad().view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
    scaler.unscale(shards);
    EXPECT_FALSE(scaler.step([&] { opt.step(); }, shards)) << "rank " << pg.rank();
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 128.0);
    for (size_t i = 0; i < shards.size(); ++i) EXPECT_TRUE(at::equal(shards[i], before[i])) << i;

    opt.zero_grad();
    scaler.scale(model->forward(at::ones({2, 6})).sum()).backward();
    EXPECT_TRUE(scaler.step([&] { opt.step(); }, shards)) << "rank " << pg.rank();
    scaler.update();
    EXPECT_FALSE(at::equal(shards[0], before[0]));
  });
}

TEST(GradScaler, UnscaleWithoutAnyGradientAgreesOnFinite) {
  // A rank may hold no gradient at all (ZeRO-2 with fewer parameters than ranks); it still joins
  // the agreement, and an inf elsewhere makes it skip too.
  dtrain::testing::run_ranks(2, [](comm::ProcessGroup& pg) {
    auto lin = make_linear();
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(64), pg);
    std::vector<at::Tensor> held;
    if (pg.rank() == 0) {
      scaler.scale(lin->forward(at::ones({1, 4})).sum()).backward();
      held = lin->parameters();
    }
    scaler.unscale(held);
    EXPECT_FALSE(scaler.found_inf()) << "rank " << pg.rank();
    if (pg.rank() == 0) EXPECT_TRUE(at::allclose(lin->bias.grad(), at::ones({2})));  // d(sum)/d(bias), unscaled
    EXPECT_TRUE(scaler.step([] {}, held));
    scaler.update();
    if (pg.rank() == 0) lin->weight.grad()[1][2] = std::numeric_limits<float>::infinity();
    scaler.unscale(held);
    EXPECT_TRUE(scaler.found_inf()) << "rank " << pg.rank();
    EXPECT_FALSE(scaler.step([] {}, held));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 32.0);
  });
}

TEST(GradScaler, GradientsOnCudaAndCpuAreCheckedWhereTheyLive) {
  // FSDP's cpu_offload: some gradients on the GPU, some on the CPU, the group on another device;
  // the finding is agreed across ranks and the gradients are unscaled in place. (Never run: no GPU.)
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  dtrain::testing::run_ranks(2, [](comm::ProcessGroup& pg) {
    auto on_gpu = at::ones({3}, at::TensorOptions().device(at::kCUDA)).requires_grad_();
    auto on_cpu = at::ones({2}).requires_grad_();
    amp::GradScaler scaler(amp::GradScalerOptions().init_scale(4), pg);
    (scaler.scale(on_gpu.sum() * 3) + scaler.scale(on_cpu.sum()).to(at::kCUDA)).backward();
    scaler.unscale({on_gpu, on_cpu});
    EXPECT_FALSE(scaler.found_inf());
    EXPECT_TRUE(at::equal(on_gpu.grad().cpu(), at::full({3}, 3.0f)));
    EXPECT_TRUE(at::equal(on_cpu.grad(), at::ones({2})));
    EXPECT_TRUE(scaler.step([] {}, {}));
    scaler.update();
    if (pg.rank() == 1) on_gpu.grad()[0].fill_(std::numeric_limits<float>::quiet_NaN());
    scaler.unscale({on_gpu, on_cpu});
    EXPECT_TRUE(scaler.found_inf()) << "rank " << pg.rank();
  });
}
