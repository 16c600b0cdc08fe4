// tensor_parallel::Plan::segments against the pieces Plan::piece cuts: for every cut (rows with
// stride 1 and 3, columns, whole) and every range of a rank's piece, the runs of the full tensor
// the segments name hold exactly the piece's elements of that range, in order, at TP 1-4.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "dtrain/comm.h"
#include "dtrain/tensor_parallel/linear.h"
#include "dtrain/tensor_parallel/plan.h"
#include "testing/testing.h"

using namespace dtrain;
namespace tp = dtrain::tensor_parallel;

namespace {

struct Cuts : torch::nn::Module {
  Cuts(const comm::ProcessGroup& g) {
    qkv = register_module("qkv", tp::ColumnParallelLinear(tp::ParallelLinearOptions(4, 3 * 12).stride(3), g));
    up = register_module("up", tp::ColumnParallelLinear(tp::ParallelLinearOptions(4, 12), g));
    down = register_module("down", tp::RowParallelLinear(tp::ParallelLinearOptions(12, 4), g));
  }
  tp::ColumnParallelLinear qkv{nullptr}, up{nullptr};
  tp::RowParallelLinear down{nullptr};
};

class TensorParallelPlan : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelPlan, SegmentsLocateEveryRangeOfAPiece) {
  dtrain::testing::run_ranks(GetParam(), [](comm::ProcessGroup& g) {
    Cuts model(g);
    const tp::Plan plan = tp::Plan::of(model, g);
    for (const auto& item : model.named_parameters()) {
      const std::string name = item.key();
      const auto shape = plan.full_shape(name, item.value().sizes().vec());
      const at::Tensor full = at::arange(c10::multiply_integers(shape), at::kLong).view(shape);
      const at::Tensor piece = plan.piece(name, full).reshape({-1});
      ASSERT_EQ(piece.numel(), item.value().numel()) << name;
      const int64_t n = piece.numel();
      for (int64_t begin = 0; begin <= n; begin += 5) {
        for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, n - begin}) {
          if (begin + count > n) continue;
          std::vector<at::Tensor> parts;
          int64_t next = begin;
          for (const auto& s : plan.segments(name, item.value().sizes().vec(), begin, count)) {
            EXPECT_EQ(s.piece_begin, next) << name;  // in order, no gap
            next += s.count;
            parts.push_back(full.reshape({-1}).narrow(0, s.full_begin, s.count));
          }
          EXPECT_EQ(next, begin + count) << name;
          if (count == 0) continue;
          EXPECT_TRUE(at::equal(at::cat(parts), piece.narrow(0, begin, count)))
              << name << " [" << begin << ", " << begin + count << ") on rank " << g.rank() << " of " << g.size();
        }
      }
    }
    EXPECT_THROW(plan.segments("up.weight", model.up->weight.sizes().vec(), 1, model.up->weight.numel()), c10::Error);
  });
}

INSTANTIATE_TEST_SUITE_P(Tp, TensorParallelPlan, ::testing::Values(1, 2, 3, 4));

}  // namespace
