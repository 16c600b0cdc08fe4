// A tensor-parallel transformer block against models::GPTBlock with the same values: output, input
// gradient and each rank's piece of every parameter gradient, at TP 1, 2 and 4 (4 heads), with and
// without sequence parallelism; bad degrees are clear errors.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>

#include "dtrain/comm.h"
#include "dtrain/models/gpt.h"
#include "dtrain/tensor_parallel/block.h"
#include "dtrain/tensor_parallel/plan.h"
#include "dtrain/tensor_parallel/regions.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;
namespace tp = dtrain::tensor_parallel;

namespace {

models::GPTOptions options() {
  return models::GPTOptions().d_model(16).heads(4).mlp_ratio(4).fused_attention(false);
}

class TensorParallelBlock : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelBlock, EqualsGptBlock) {
  const int n = GetParam();
  models::GPTBlock plain(nullptr);
  {
    std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
    torch::manual_seed(21);
    plain = models::GPTBlock(options());
    // Non-trivial LayerNorm values and biases, so their pieces and gradients are checked too.
    at::NoGradGuard no_grad;
    for (auto& p : plain->parameters()) p.copy_(at::randn(p.sizes()) * 0.2 + (p.dim() == 1 ? 0.5 : 0.0));
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const at::Tensor x_full = at::randn({2, 8, 16}, gen);
  const at::Tensor probe = at::randn({2, 8, 16}, gen);
  at::Tensor xr = x_full.clone().requires_grad_(true);
  at::Tensor yr = plain(xr);
  (yr * probe).sum().backward();

  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    std::mutex mu;
    run_ranks(n, [&](comm::ProcessGroup& pg) {
      tp::ParallelBlock block(options(), pg, sp);
      const auto plan = tp::Plan::of(*block, pg);
      tp::load_pieces(*block, *plain, plan);
      at::Tensor x = (sp ? tp::slice_along(x_full, pg, 1) : x_full.clone()).requires_grad_(true);
      at::Tensor y = block(x);
      (y * (sp ? tp::slice_along(probe, pg, 1) : probe)).sum().backward();
      std::lock_guard<std::mutex> lock(mu);
      const std::string r = "rank " + std::to_string(pg.rank()) + " of " + std::to_string(n);
      auto close = [&](const at::Tensor& a, const at::Tensor& b, const std::string& what) {
        ASSERT_EQ(a.sizes(), b.sizes()) << r << ": " << what;
        EXPECT_LT((a - b).abs().max().item<double>(), 2e-5) << r << ": " << what;
      };
      close(y, sp ? tp::slice_along(yr.detach(), pg, 1) : yr.detach(), "output");
      close(x.grad(), sp ? tp::slice_along(xr.grad(), pg, 1) : xr.grad(), "input gradient");
      const auto mine_by_name = block->named_parameters();  // (find() points into it: keep it alive)
      for (const auto& item : plain->named_parameters()) {
        const at::Tensor* mine = mine_by_name.find(item.key());
        ASSERT_NE(mine, nullptr) << item.key();
        close(mine->grad(), plan.piece(item.key(), item.value().grad()), item.key() + " gradient");
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Degrees, TensorParallelBlock, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& i) { return "tp" + std::to_string(i.param); });

TEST(TensorParallelBlockErrors, HeadsThatDoNotDivideAreAClearError) {
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    try {
      tp::ParallelBlock(options(), pg);
      ADD_FAILURE() << "4 heads over 3 ranks was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("4 attention heads do not divide by the tensor-parallel degree 3"),
                std::string::npos) << e.what();
    }
  });
}

}  // namespace
