// Tensor-parallel linear layers against plain torch::nn::Linear (same seed, same input): outputs,
// input gradients and each rank's slice of the parameter gradients, at TP 1-4 (threads over one
// store), with and without sequence parallelism; bad sizes are clear errors.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/comm.h"
#include "dtrain/tensor_parallel/linear.h"
#include "dtrain/tensor_parallel/regions.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;
namespace tp = dtrain::tensor_parallel;

namespace {

constexpr int64_t kIn = 8, kHidden = 12, kBatch = 2, kSeq = 12;

struct Reference {
  at::Tensor x, y, dx, up_w, up_b, down_w, down_b;  // values of the weights; grads below
  at::Tensor g_up_w, g_up_b, g_down_w, g_down_b;
};

// up: Linear(8, 12), gelu, down: Linear(12, 8); loss = sum(y * y) / numel.
Reference reference() {
  Reference r;
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  torch::manual_seed(11);
  torch::nn::Linear up(kIn, kHidden), down(kHidden, kIn);
  r.x = at::randn({kBatch, kSeq, kIn}).requires_grad_(true);
  r.y = down(at::gelu(up(r.x)));
  (r.y * r.y).mean().backward();
  r.dx = r.x.grad();
  r.up_w = up->weight.detach();
  r.g_up_w = up->weight.grad();
  r.g_up_b = up->bias.grad();
  r.g_down_w = down->weight.grad();
  r.g_down_b = down->bias.grad();
  return r;
}

void expect_close(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_LT((a - b).abs().max().item<double>(), 1e-5) << what;
}

class TensorParallelLinear : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelLinear, EqualsPlainLinear) {
  const int n = GetParam();
  const Reference ref = reference();
  for (int mode = 0; mode < 3; ++mode) {  // 0: plain, 1: sequence parallel, 2: gathered output + row slices its input
    SCOPED_TRACE(mode == 0 ? "tensor parallel" : mode == 1 ? "sequence parallel" : "gather_output / input_is_parallel false");
    std::mutex mu;
    run_ranks(n, [&](comm::ProcessGroup& pg) {
      tp::ColumnParallelLinear up(nullptr);
      tp::RowParallelLinear down(nullptr);
      {
        std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
        torch::manual_seed(11);
        up = tp::ColumnParallelLinear(
            tp::ParallelLinearOptions(kIn, kHidden).sequence_parallel(mode == 1).gather_output(mode == 2), pg);
        down = tp::RowParallelLinear(
            tp::ParallelLinearOptions(kHidden, kIn).sequence_parallel(mode == 1).input_is_parallel(mode != 2), pg);
      }
      at::Tensor x = ref.x.detach().clone();
      if (mode == 1) x = tp::slice_along(x, pg, 1);  // this rank's part of the sequence
      x.requires_grad_(true);
      at::Tensor y = down(at::gelu(up(x)));
      // The loss over the whole output: with sequence parallelism each rank holds a part of it.
      at::Tensor loss = (y * y).sum() / static_cast<double>(ref.y.numel());
      loss.backward();
      std::lock_guard<std::mutex> lock(mu);
      const std::string r = "rank " + std::to_string(pg.rank()) + " of " + std::to_string(n);
      expect_close(y, mode == 1 ? tp::slice_along(ref.y, pg, 1) : ref.y.detach(), r + ": output");
      expect_close(x.grad(), mode == 1 ? tp::slice_along(ref.dx, pg, 1) : ref.dx, r + ": input gradient");
      expect_close(up->weight, tp::slice_along(ref.up_w, pg, 0), r + ": column weight (its rows)");
      expect_close(up->weight.grad(), tp::slice_along(ref.g_up_w, pg, 0), r + ": column weight gradient");
      expect_close(up->bias.grad(), tp::slice_along(ref.g_up_b, pg, 0), r + ": column bias gradient");
      expect_close(down->weight.grad(), tp::slice_along(ref.g_down_w, pg, 1), r + ": row weight gradient");
      expect_close(down->bias.grad(), ref.g_down_b, r + ": row bias gradient (whole on every rank)");
      EXPECT_EQ(up->shard_dim("weight"), 0);
      EXPECT_EQ(down->shard_dim("weight"), 1);
      EXPECT_EQ(down->shard_dim("bias"), -1);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Degrees, TensorParallelLinear, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) { return "tp" + std::to_string(i.param); });

TEST(TensorParallelErrors, SizesThatDoNotDivideAreClearErrors) {
  run_ranks(4, [&](comm::ProcessGroup& pg) {
    try {
      tp::ColumnParallelLinear(tp::ParallelLinearOptions(8, 10), pg);
      ADD_FAILURE() << "10 output features over 4 ranks was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("out_features 10 does not divide by the tensor-parallel degree 4"),
                std::string::npos) << e.what();
    }
    try {
      tp::RowParallelLinear(tp::ParallelLinearOptions(6, 8), pg);
      ADD_FAILURE() << "6 input features over 4 ranks was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("in_features 6 does not divide"), std::string::npos) << e.what();
    }
    // A sequence that does not divide: the error names the sizes and the rank.
    try {
      (void)tp::slice_along(at::zeros({2, 6, 8}), pg, 1);
      ADD_FAILURE() << "a sequence of 6 over 4 ranks was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("size 6 along dim 1 does not divide by the 4 ranks"), std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
