// Gradient compression (Design note [gradient compression], ddp/comm_hook.h) against its formulas
// on known tensors, at W = 1, 2, 3 and uneven sizes, one thread per rank over Gloo: the bf16/fp16
// reductions (their bytes too), PowerSGD (against a reference written here from the paper's
// steps, with error feedback and warm start over several steps), and its state's round trip.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "dtrain/comm.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/ddp/comm_hook.h"
#include "dtrain/ddp/powersgd.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

namespace {

at::Tensor hook_values(int rank, int step, int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7919 * (step + 1) + rank);
  return at::randn({n}, gen) * (rank + 1);
}

// The mean as the design note computes it: each rank's values / W rounded to `dtype`, summed in
// fp32, the sum rounded to `dtype`.
at::Tensor hook_cast_mean(int world, int64_t n, at::ScalarType dtype) {
  std::vector<at::Tensor> rows;
  for (int r = 0; r < world; ++r) rows.push_back(hook_values(r, 0, n).div(world).to(dtype));
  return at::stack(rows).sum(0, false, at::kFloat).to(dtype).to(at::kFloat);
}

}  // namespace

class CastCompression : public ::testing::TestWithParam<int> {};

TEST_P(CastCompression, ReductionsEqualTheirFormulaAndSendHalfTheBytes) {
  const int world = GetParam();
  const int64_t n = 1001;  // (uneven over 2 and 3 ranks)
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor expected = hook_cast_mean(world, n, dtype);
    std::mutex mu;
    int64_t narrow_bytes = 0, full_bytes = 0;
    run_ranks(world, [&](comm::ProcessGroup& pg) {
      auto counted = [&pg] { return dtrain::testing::traffic_at_rest(pg).ring_bytes_sent; };
      const int64_t b0 = counted();
      at::Tensor t = hook_values(pg.rank(), 0, n);
      ddp::compressed_all_reduce(pg, t, dtype).wait();
      const int64_t b1 = counted();
      if (comm::reduces_natively(pg, dtype) && world > 2) {
        // One ring all-reduce in the narrow dtype (Gloo's fp16): each partial sum rounded, so within
        // a rounding per rank of the formula's single one (at W = 2 the two are the same).
        EXPECT_LE((t - expected).abs().max().item<double>(), world * std::ldexp(1.0, -10) * expected.abs().max().item<double>());
      } else {
        EXPECT_TRUE(at::equal(t, expected)) << "rank " << pg.rank() << ": max diff " << (t - expected).abs().max().item<float>();
      }
      at::Tensor full = hook_values(pg.rank(), 0, n);
      comm::all_reduce(pg, full);
      const int64_t b2 = counted();
      // ZeRO-2's: this rank's part of the same mean (uneven counts, one rank owning nothing at W = 3).
      std::vector<int64_t> counts = comm::even_split(n, world);
      if (world == 3) counts = {600, 0, 401};
      const std::vector<int64_t> offsets = comm::offsets_of(counts);
      at::Tensor part = at::zeros({counts[pg.rank()]});
      ddp::compressed_reduce_scatter(pg, part, hook_values(pg.rank(), 0, n), counts, dtype).wait();
      EXPECT_TRUE(at::equal(part, expected.narrow(0, offsets[pg.rank()], counts[pg.rank()]))) << "rank " << pg.rank();
      if (pg.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        narrow_bytes = b1 - b0;
        full_bytes = b2 - b1;
      }
    });
    if (world > 1) {
      EXPECT_NEAR(static_cast<double>(narrow_bytes) / static_cast<double>(full_bytes), 0.5, 0.02)
          << narrow_bytes << " bytes against fp32's " << full_bytes;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(World, CastCompression, ::testing::Values(1, 2, 3));

// In two levels (Design note [gradient compression], its two-level paragraph): 4 ranks on two
// "nodes". Each node's part is the fp32 sum of its ranks' values / 2 rounded to `dtype`, rounded
// once; across, the mean of the two nodes' parts rounded once (halving is exact); so the result
// equals that formula to the bit. Across the nodes it sends a third of the flat fp32 ring's bytes
// (16 bits instead of 32, and 2 (n - 1) / n = 1 of the tensor instead of 2 (W - 1) / W = 1.5).
TEST(CastCompression, InTwoLevelsEqualsItsFormulaAndCrossesAThirdOfTheBytes) {
  const int64_t n = 1001;
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto node_part = [&](int first) {
      const at::Tensor a = hook_values(first, 0, n).div(2).to(dtype), b = hook_values(first + 1, 0, n).div(2).to(dtype);
      return (a.to(at::kFloat) + b.to(at::kFloat)).to(dtype).to(at::kFloat);
    };
    const at::Tensor expected = ((node_part(0) + node_part(2)) / 2).to(dtype).to(at::kFloat);
    std::vector<int64_t> across(2, 0);
    run_ranks(
        4,
        [&](comm::ProcessGroup& pg) {
          const comm::NodeGroups nodes = comm::split_by_node(pg);
          ASSERT_TRUE(nodes.two_level());
          auto crossed = [&pg] { return dtrain::testing::traffic_at_rest(pg).across_nodes_sent; };
          const int64_t a0 = crossed();
          at::Tensor t = hook_values(pg.rank(), 0, n);
          ddp::compressed_two_level_all_reduce(nodes, t, dtype).wait();
          const int64_t a1 = crossed();
          at::Tensor flat = hook_values(pg.rank(), 0, n);
          comm::all_reduce(pg, flat);
          const int64_t a2 = crossed();
          EXPECT_TRUE(at::equal(t, expected)) << "rank " << pg.rank() << ": max diff " << (t - expected).abs().max().item<float>();
          if (pg.rank() == 0) across = {a1 - a0, a2 - a1};
        },
        20000, {0, 0, 1, 1});
    ASSERT_GT(across[0], 0);
    EXPECT_NEAR(static_cast<double>(across[1]) / static_cast<double>(across[0]), 3.0, 0.05)
        << across[0] << " bytes across against the flat fp32 ring's " << across[1];
  }
}

TEST(CastCompression, RefusesGradientsAlreadyNarrow) {
  run_ranks(1, [](comm::ProcessGroup& pg) {
    at::Tensor t = at::ones({4}, at::kBFloat16);
    EXPECT_THROW(ddp::compressed_all_reduce(pg, t, at::kBFloat16), c10::Error);
    EXPECT_THROW(ddp::cast_hook(at::kFloat), c10::Error);
  });
}

namespace {

// A bucket of gradients shaped as a small model's: a matrix PowerSGD compresses at rank 2
// ((16 + 12) x 2 x 2 < 16 x 12), a bias, a matrix too small to gain (3 x 2: (3 + 2) x 2 x 2 >= 6)
// and a 3-D weight (10 x 4 x 4 -> 10 x 16).
const std::vector<std::vector<int64_t>> kHookShapes = {{16, 12}, {7}, {3, 2}, {10, 4, 4}};
constexpr int64_t kHookRank = 2;

int64_t hook_bucket_numel() {
  int64_t n = 0;
  for (const auto& s : kHookShapes) n += c10::multiply_integers(s);
  return n;
}

ddp::GradBucket hook_bucket_of(at::Tensor buffer) {
  ddp::GradBucket b{0, buffer, {}, true};
  int64_t at = 0;
  for (const auto& s : kHookShapes) {
    const int64_t n = c10::multiply_integers(s);
    b.grads.push_back(buffer.narrow(0, at, n).view(s));
    at += n;
  }
  return b;
}

// Gram-Schmidt written out element by element (double), as the paper's orthogonalization.
at::Tensor hook_reference_orthogonalize(const at::Tensor& m) {
  at::Tensor a = m.to(at::kDouble).clone();
  auto x = a.accessor<double, 2>();
  for (int64_t i = 0; i < a.size(1); ++i) {
    double norm = 0;
    for (int64_t k = 0; k < a.size(0); ++k) norm += x[k][i] * x[k][i];
    norm = std::max(std::sqrt(norm), static_cast<double>(FLT_MIN));
    for (int64_t k = 0; k < a.size(0); ++k) x[k][i] /= norm;
    for (int64_t j = i + 1; j < a.size(1); ++j) {
      double dot = 0;
      for (int64_t k = 0; k < a.size(0); ++k) dot += x[k][i] * x[k][j];
      for (int64_t k = 0; k < a.size(0); ++k) x[k][j] -= dot * x[k][i];
    }
  }
  return a.to(m.scalar_type());
}

// What every rank's bucket holds after each step and each rank's error, computed for all ranks
// at once from the formulas in ddp/powersgd.h.
struct PowerSgdReference {
  int world;
  int64_t warmup;
  std::vector<at::Tensor> errors;  // per rank, flat
  std::vector<at::Tensor> qs;      // per compressed matrix

  PowerSgdReference(int w, int64_t warm, uint64_t seed) : world(w), warmup(warm), errors(w, at::zeros({hook_bucket_numel()})) {
    // The first Qs: one draw of every Q's elements in bucket order from seed + bucket index (0).
    int64_t total = 0;
    for (const auto& s : kHookShapes) total += compressed(s) ? (c10::multiply_integers(s) / s[0]) * kHookRank : 0;
    at::Tensor flat = at::randn({total}, at::detail::createCPUGenerator(seed));
    int64_t at = 0;
    for (const auto& s : kHookShapes) {
      if (!compressed(s)) continue;
      const int64_t m = c10::multiply_integers(s) / s[0];
      qs.push_back(hook_reference_orthogonalize(flat.narrow(0, at, m * kHookRank).view({m, kHookRank})));
      at += m * kHookRank;
    }
  }
  static bool compressed(const std::vector<int64_t>& s) {
    if (s.size() < 2) return false;
    const int64_t n = s[0], m = c10::multiply_integers(s) / n;
    return 2.0 * (n + m) * kHookRank < n * m;
  }
  at::Tensor step(int t) {
    std::vector<at::Tensor> in;
    for (int r = 0; r < world; ++r) in.push_back(hook_values(r, t, hook_bucket_numel()) + (t >= warmup ? errors[r] : at::zeros({1})));
    at::Tensor mean = at::stack(in).mean(0);
    if (t < warmup) return mean;
    at::Tensor out = mean.clone();
    int64_t at = 0;
    size_t qi = 0;
    for (const auto& s : kHookShapes) {
      const int64_t numel = c10::multiply_integers(s);
      if (compressed(s)) {
        const int64_t n = s[0], m = numel / n;
        at::Tensor p = at::zeros({n, kHookRank});
        for (int r = 0; r < world; ++r) p += in[r].narrow(0, at, numel).view({n, m}).matmul(qs[qi]);
        p = hook_reference_orthogonalize(p);
        at::Tensor q = at::zeros({m, kHookRank});
        for (int r = 0; r < world; ++r) q += in[r].narrow(0, at, numel).view({n, m}).t().matmul(p);
        qs[qi] = q / world;
        out.narrow(0, at, numel).copy_(p.matmul(qs[qi].t()).view({-1}));
        ++qi;
      }
      at += numel;
    }
    for (int r = 0; r < world; ++r) errors[r] = in[r] - out;
    return out;
  }
};

}  // namespace

class PowerSgd : public ::testing::TestWithParam<int> {};

TEST_P(PowerSgd, MatchesItsFormulaWithErrorFeedbackAndWarmStart) {
  const int world = GetParam();
  constexpr int kSteps = 5, kWarmup = 1;
  PowerSgdReference ref(world, kWarmup, 11);
  std::vector<at::Tensor> expected;
  for (int t = 0; t < kSteps; ++t) expected.push_back(ref.step(t));
  run_ranks(world, [&](comm::ProcessGroup& pg) {
    auto hook = ddp::powersgd_hook(ddp::PowerSGDOptions().rank(kHookRank).warmup_steps(kWarmup).seed(11));
    EXPECT_EQ(hook->name(), "powersgd:2");
    for (int t = 0; t < kSteps; ++t) {
      at::Tensor buffer = hook_values(pg.rank(), t, hook_bucket_numel());
      ddp::GradBucket b = hook_bucket_of(buffer);
      hook->reduce(pg, b).wait();
      const double diff = (buffer - expected[t]).abs().max().item<double>();
      EXPECT_LT(diff, 1e-4 * expected[t].abs().max().item<double>()) << "rank " << pg.rank() << " step " << t;
    }
    // The error it keeps is this rank's own.
    at::Tensor error;
    for (const auto& [name, v] : hook->state()) {
      if (name == "bucket0/error") error = v;
    }
    ASSERT_TRUE(error.defined());
    ASSERT_GT(ref.errors[pg.rank()].abs().max().item<double>(), 0.01);  // (the compression left something out)
    EXPECT_LT((error - ref.errors[pg.rank()]).abs().max().item<double>(), 1e-4 * ref.errors[pg.rank()].abs().max().item<double>());
  });
}

INSTANTIATE_TEST_SUITE_P(World, PowerSgd, ::testing::Values(1, 2, 3));

TEST(PowerSgd, ItsStateResumesBitExact) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    const auto options = ddp::PowerSGDOptions().rank(kHookRank).warmup_steps(1).seed(3);
    auto a = ddp::powersgd_hook(options);
    for (int t = 0; t < 3; ++t) {
      ddp::GradBucket b = hook_bucket_of(hook_values(pg.rank(), t, hook_bucket_numel()));
      a->reduce(pg, b).wait();
    }
    auto b = ddp::powersgd_hook(options);
    b->load_state(a->state());
    at::Tensor x = hook_values(pg.rank(), 3, hook_bucket_numel()), y = x.clone();
    ddp::GradBucket bx = hook_bucket_of(x), by = hook_bucket_of(y);
    a->reduce(pg, bx).wait();
    b->reduce(pg, by).wait();
    EXPECT_TRUE(at::equal(x, y));
    // A fresh hook (no state) is another run: it warms up again, so its result differs.
    auto c = ddp::powersgd_hook(options);
    at::Tensor z = hook_values(pg.rank(), 3, hook_bucket_numel());
    ddp::GradBucket bz = hook_bucket_of(z);
    c->reduce(pg, bz).wait();
    EXPECT_FALSE(at::equal(x, z));
  });
}

TEST(PowerSgd, AnOverflowedStepIsForgottenByTheNext) {
  // An fp16 loss scale that overflowed gives inf gradients for a step (the scaler skips it); the
  // warm-started Q and the error must not carry the inf or NaN into the steps after.
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto hook = ddp::powersgd_hook(ddp::PowerSGDOptions().rank(kHookRank).warmup_steps(0).seed(3));
    for (int t = 0; t < 4; ++t) {
      at::Tensor x = hook_values(pg.rank(), t, hook_bucket_numel());
      if (t == 1 && pg.rank() == 0) x[5] = std::numeric_limits<float>::infinity();
      ddp::GradBucket b = hook_bucket_of(x);
      hook->reduce(pg, b).wait();
      if (t != 1) EXPECT_TRUE(at::isfinite(x).all().item<bool>()) << "step " << t << " rank " << pg.rank();
    }
  });
}
