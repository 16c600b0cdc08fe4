// The GPT built from tensor-parallel layers trains like the plain GPT in one process: same batches,
// AdamW, fp32, 10 steps; every rank's loss and its piece of every parameter equal one process's
// (1e-5), at TP 1, 2 and 4, with and without sequence parallelism.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include "dtrain/comm.h"
#include "dtrain/models/gpt.h"
#include "dtrain/models/parallel_gpt.h"
#include "dtrain/tensor_parallel/plan.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

namespace {

constexpr int kSteps = 10;

models::GPTOptions gpt_options() {
  return models::GPTOptions().vocab_size(32).seq_len(8).layers(2).d_model(16).heads(4).fused_attention(false).seed(3);
}

std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  at::Tensor tokens = at::randint(32, {2, 9}, gen);
  return {tokens.narrow(1, 0, 8).contiguous(), tokens.narrow(1, 1, 8).contiguous()};
}

class ParallelGpt : public ::testing::TestWithParam<int> {};

TEST_P(ParallelGpt, TrainsLikeTheGptInOneProcess) {
  const int n = GetParam();
  models::GPT plain(gpt_options());
  models::GPT start(gpt_options());  // the initial values every run loads
  torch::optim::AdamW opt(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto [x, y] = batch(s);
    at::Tensor loss = models::gpt_loss(plain(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    std::mutex mu;
    run_ranks(n, [&](comm::ProcessGroup& pg) {
      models::ParallelGPT model(nullptr);
      {
        std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
        model = models::ParallelGPT(gpt_options(), pg, sp);
      }
      model->load_from(*start);
      torch::optim::AdamW topt(model->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int s = 0; s < kSteps; ++s) {
        topt.zero_grad();
        auto [x, y] = batch(s);
        at::Tensor loss = model->loss(model(x), y);
        loss.backward();
        topt.step();
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_NEAR(loss.item<double>(), losses[s], 1e-5) << "rank " << pg.rank() << " step " << s;
      }
      const auto plan = tensor_parallel::Plan::of(*model, pg);
      std::lock_guard<std::mutex> lock(mu);
      const auto mine_by_name = model->named_parameters();  // (find() points into it: keep it alive)
      for (const auto& item : plain->named_parameters()) {
        const at::Tensor* mine = mine_by_name.find(item.key());
        ASSERT_NE(mine, nullptr) << item.key();
        at::Tensor diff = (*mine - plan.piece(item.key(), item.value())).abs();
        if (item.key().find("qkv.bias") != std::string::npos) {
          // The bias of k has a zero gradient in exact arithmetic (softmax ignores q . b_k, the same
          // for every key), so each run steps it by AdamW-normalised rounding noise: only q's and
          // v's thirds of this rank's piece [q | k | v] are held to 1e-5, k's to 1e-3.
          const auto thirds = diff.chunk(3);
          EXPECT_LT(thirds[1].max().item<double>(), 1e-3) << item.key() << " (k) on rank " << pg.rank();
          diff = at::cat({thirds[0], thirds[2]});
        }
        EXPECT_LT(diff.max().item<double>(), 1e-5) << item.key() << " on rank " << pg.rank() << " of " << n;
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Degrees, ParallelGpt, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& i) { return "tp" + std::to_string(i.param); });

}  // namespace
