// clip_grad_norm over sharded gradients against torch::nn::utils::clip_grad_norm_ on the full
// gradients in one process, W = 1, 2, 3; and ZeRO-2 + clipping + AdamW against one process.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/ddp/sharded_data_parallel.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double clip_rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }
double max_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

// Parameters of assorted sizes (uneven shards) with fixed gradients; one without a gradient.
std::vector<at::Tensor> params_with_grads() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::vector<std::vector<int64_t>> shapes{{40, 6}, {40}, {24, 40}, {24}, {3, 24}, {3}, {5}};
  std::vector<at::Tensor> ps;
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto p = at::randn(shapes[i], gen).requires_grad_();
    if (i != 5) p.mutable_grad() = at::randn(shapes[i], gen) * static_cast<double>(i + 1);
    ps.push_back(p);
  }
  return ps;
}

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<torch::optim::OptimizerParamGroup> g) {
  return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.1));
}

std::string norm_name(double p) { return std::isinf(p) ? "Inf" : std::to_string(static_cast<int>(p)); }

}  // namespace

// (world, norm type, every rank holds every gradient (ZeRO-1) or only its own (ZeRO-2))
class ClipGradNorm : public ::testing::TestWithParam<std::tuple<int, double, bool>> {};

TEST_P(ClipGradNorm, EqualsTheUnshardedNormAndClip) {
  const auto [W, p, all_grads] = GetParam();
  for (double max_norm : {0.5, 1e6}) {  // clipped, and left alone
    auto ref = params_with_grads();
    const double expect_norm = torch::nn::utils::clip_grad_norm_(ref, max_norm, p);
    run_ranks(W, [&, W = W, p = p, all_grads = all_grads](comm::ProcessGroup& pg) {
      const int r = pg.rank();
      auto ps = params_with_grads();
      optim::ShardedOptimizer opt(ps, pg, make_sgd);
      const auto& owner = opt.partition().owner;
      if (!all_grads) {
        for (size_t i = 0; i < ps.size(); ++i) {
          if (owner[i] != r) ps[i].mutable_grad() = at::Tensor();
        }
      }
      auto before = params_with_grads();
      const double norm = optim::clip_grad_norm(pg, opt, max_norm, p);
      EXPECT_LT(clip_rel(norm, expect_norm), 1e-6) << "rank " << r << " of " << W;
      for (size_t i = 0; i < ps.size(); ++i) {
        if (!ps[i].grad().defined()) {
          EXPECT_TRUE(!ref[i].grad().defined() || owner[i] != r);
          continue;
        }
        // Owned gradients clipped as torch clips the full set; others (ZeRO-1) left as they were.
        const at::Tensor& expect = owner[i] == r ? ref[i].grad() : before[i].grad();
        EXPECT_LT(max_rel_diff(ps[i].grad(), expect), 1e-6) << "param " << i << " rank " << r;
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsNormsAndLayouts, ClipGradNorm,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(2.0, kInf, 1.0),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_Norm" +
                                  norm_name(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_AllGrads" : "_OwnedGrads");
                         });

TEST(ClipGradNormPlain, ProcessGroupAndThisRanksParams) {
  // The plain overload: each rank passes a disjoint share; the norm is over all of them.
  auto ref = params_with_grads();
  const double expect = torch::nn::utils::clip_grad_norm_(ref, 0.25, 2.0);
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    auto ps = params_with_grads();
    std::vector<at::Tensor> mine;
    for (size_t i = pg.rank(); i < ps.size(); i += 2) mine.push_back(ps[i]);
    EXPECT_LT(clip_rel(optim::clip_grad_norm(pg, mine, 0.25), expect), 1e-6);
    for (size_t i = pg.rank(); i < ps.size(); i += 2) {
      if (ps[i].grad().defined()) EXPECT_LT(max_rel_diff(ps[i].grad(), ref[i].grad()), 1e-6);
    }
  });
}

TEST(ClipGradNormPlain, NonFiniteNormAndBadNormType) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    auto ps = params_with_grads();
    if (pg.rank() == 1) ps[1].mutable_grad()[0] = std::numeric_limits<float>::infinity();
    std::vector<at::Tensor> mine{ps[pg.rank()]};
    try {
      optim::clip_grad_norm(pg, mine, 1.0, 2.0, /*error_if_nonfinite=*/true);
    } catch (const c10::Error& e) {
      errors[pg.rank()] = e.what();
    }
    EXPECT_THROW(optim::clip_grad_norm(pg, mine, 1.0, -1.0), c10::Error);
  });
  for (const auto& e : errors) EXPECT_NE(e.find("-norm of the gradients is inf"), std::string::npos) << e;
}

// ---- ZeRO-2 + clipping + AdamW against one process with clip_grad_norm_ -------------------------

namespace {


using dtrain::testing::Mlp;
Mlp make_mlp() { return dtrain::testing::make_mlp(5); }

std::pair<at::Tensor, at::Tensor> clip_batch(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  return {at::randn({rows, 6}, gen), at::randn({rows, 3}, gen) * 3};
}

std::unique_ptr<torch::optim::Optimizer> make_adamw(std::vector<torch::optim::OptimizerParamGroup> g) {
  return std::make_unique<torch::optim::AdamW>(std::move(g), torch::optim::AdamWOptions(1e-2));
}

constexpr int kClipSteps = 10, kB = 4;
constexpr double kMaxNorm = 0.5;

}  // namespace

class Zero2ClipParity : public ::testing::TestWithParam<std::tuple<int, double>> {};

TEST_P(Zero2ClipParity, MatchesOneProcessWithClipping) {
  const auto [W, p] = GetParam();
  Mlp ref = make_mlp();
  auto plain = make_adamw({torch::optim::OptimizerParamGroup(ref->parameters())});
  std::vector<double> ref_norms;
  for (int t = 0; t < kClipSteps; ++t) {
    plain->zero_grad();
    auto [x, y] = clip_batch(t, W * kB);
    at::mse_loss(ref->forward(x), y).backward();
    ref_norms.push_back(torch::nn::utils::clip_grad_norm_(ref->parameters(), kMaxNorm, p));
    plain->step();
  }
  int clipped = 0;
  for (double n : ref_norms) clipped += n > kMaxNorm;
  EXPECT_GT(clipped, 0) << "the reference should clip at least once";
  run_ranks(W, [&, W = W, p = p](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    Mlp net = make_mlp();
    optim::ShardedOptimizer opt(net->parameters(), pg, make_adamw);
    auto model = ddp::ShardedDataParallel<Mlp>(net, pg, opt, ddp::ShardedDataParallelOptions().bucket_cap_mb(0.002));
    for (int t = 0; t < kClipSteps; ++t) {
      opt.zero_grad();
      auto [x, y] = clip_batch(t, W * kB);
      at::mse_loss(model->forward(x.narrow(0, r * kB, kB)), y.narrow(0, r * kB, kB)).backward();
      const double norm = optim::clip_grad_norm(pg, opt, kMaxNorm, p);
      EXPECT_LT(clip_rel(norm, ref_norms[t]), 1e-5) << "step " << t << " rank " << r;
      opt.step();
    }
    auto mine = net->parameters();
    auto expect = ref->parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      EXPECT_LT(max_rel_diff(mine[i], expect[i]), 1e-5) << "param " << i << " rank " << r;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndNorms, Zero2ClipParity,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(2.0, kInf)),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_Norm" +
                                  norm_name(std::get<1>(info.param));
                         });
