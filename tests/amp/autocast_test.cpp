// Autocast regions on CPU (bf16) and activation checkpointing under them.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/compat.h"
#include "dtrain/recompute/checkpoint.h"

using namespace dtrain;

TEST(Autocast, Bf16RegionOnCpuAndRestore) {
  torch::nn::Linear lin(8, 4);
  auto x = at::randn({2, 8});
  EXPECT_EQ(lin->forward(x).scalar_type(), at::kFloat);
  {
    amp::AutocastGuard guard(c10::kCPU, at::kBFloat16);
    EXPECT_TRUE(compat::autocast_enabled(c10::kCPU));
    EXPECT_EQ(lin->forward(x).scalar_type(), at::kBFloat16);
    {
      amp::AutocastGuard off(c10::kCPU, at::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(lin->forward(x).scalar_type(), at::kFloat);
    }
    EXPECT_EQ(lin->forward(x).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(compat::autocast_enabled(c10::kCPU));
  EXPECT_EQ(lin->forward(x).scalar_type(), at::kFloat);
  EXPECT_THROW(amp::AutocastGuard(c10::kCPU, at::kHalf), c10::Error);  // fp16 autocast is CUDA-only
}

TEST(Autocast, CheckpointRecomputesUnderTheForwardsAutocast) {
  torch::manual_seed(1);
  torch::nn::Linear l1(8, 16), l2(16, 4);
  auto x = at::randn({3, 8});
  auto f = [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{l2(at::gelu(l1(in[0])))}; };
  std::vector<at::Tensor> params = l1->parameters();
  for (auto& p : l2->parameters()) params.push_back(p);
  at::Tensor y_plain, y_ckpt;
  {
    amp::AutocastGuard guard(c10::kCPU, at::kBFloat16);
    y_plain = f({x})[0];
  }
  y_plain.to(at::kFloat).pow(2).sum().backward();
  std::vector<at::Tensor> expect;
  for (auto& p : params) {
    expect.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  {
    amp::AutocastGuard guard(c10::kCPU, at::kBFloat16);
    y_ckpt = recompute::checkpoint(f, {x}, params)[0];
  }
  EXPECT_EQ(y_ckpt.scalar_type(), at::kBFloat16);
  y_ckpt.to(at::kFloat).pow(2).sum().backward();  // backward runs outside the region: the replay restores it
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(params[i].grad(), expect[i])) << i;
}
