// Design note [dropout streams]: the masks tensor-parallel dropout draws do not depend on how the
// heads or the sequence are split. With the default generator reset between calls, the masks of
// heads [0, 4) drawn at once equal those drawn as [0, 2) and [2, 4) (two ranks of TP 2), and a
// sequence-parallel rank's mask is its part of the whole activation's.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "dtrain/comm.h"
#include "dtrain/tensor_parallel/dropout.h"
#include "testing/testing.h"

using namespace dtrain;
namespace tp = dtrain::tensor_parallel;

TEST(TensorParallelDropout, HeadMasksDoNotDependOnTheSplit) {
  const at::Tensor x = at::ones({3, 4, 5, 5});
  at::manual_seed(7);
  const at::Tensor whole = tp::dropout_heads(x, 0.3, true, 0);
  at::manual_seed(7);
  const at::Tensor first = tp::dropout_heads(x.narrow(1, 0, 2), 0.3, true, 0);
  at::manual_seed(7);
  const at::Tensor second = tp::dropout_heads(x.narrow(1, 2, 2), 0.3, true, 2);
  EXPECT_TRUE(at::equal(at::cat({first, second}, 1), whole));
  // It drops (about p of the elements) and scales the rest by 1 / (1 - p).
  const double dropped = (whole == 0).to(at::kDouble).mean().item<double>();
  EXPECT_GT(dropped, 0.15);
  EXPECT_LT(dropped, 0.45);
  EXPECT_NEAR(whole.max().item<double>(), 1.0 / 0.7, 1e-6);
  // Heads differ from each other, and the next call draws new masks.
  EXPECT_FALSE(at::equal(whole.select(1, 0), whole.select(1, 1)));
  EXPECT_FALSE(at::equal(tp::dropout_heads(x, 0.3, true, 0), whole));
}

TEST(TensorParallelDropout, SequencePartsAreTheWholeMasksParts) {
  const at::Tensor x = at::ones({2, 6, 4});
  dtrain::testing::run_ranks(1, [&](comm::ProcessGroup& one) {
    at::manual_seed(9);
    const at::Tensor whole = tp::dropout_replicated(x, 0.5, true, one);
    at::manual_seed(9);
    const at::Tensor same = tp::dropout_replicated(x, 0.5, true, one, /*sequence_dim=*/1);
    EXPECT_TRUE(at::equal(same, whole));
    EXPECT_TRUE(at::equal(tp::dropout_replicated(x, 0.5, false, one), x));  // eval: identity
    EXPECT_TRUE(at::equal(tp::dropout_replicated(x, 0.0, true, one), x));
    EXPECT_THROW(tp::dropout_replicated(x, 1.0, true, one), c10::Error);
  });
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    // Rank threads share the default generator: draw the whole mask under one seed per rank in turn.
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    at::manual_seed(9);
    const at::Tensor whole = tp::dropout_replicated(x, 0.5, true, pg);
    at::manual_seed(9);
    const at::Tensor part = tp::dropout_replicated(x.narrow(1, 3 * pg.rank(), 3), 0.5, true, pg, 1);
    EXPECT_TRUE(at::equal(part, whole.narrow(1, 3 * pg.rank(), 3))) << "rank " << pg.rank();
  });
}
