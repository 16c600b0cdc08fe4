// Quantized collectives (Design note [block quantization], comm/quantized.h) against the note's
// formula written out here element by element, at W = 1, 2, 3, sizes that are not a multiple of
// the block, a block of zeros and an outlier; their round-trip bound and their bytes on the wire.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "dtrain/comm.h"
#include "dtrain/comm/quantized.h"
#include "dtrain/comm/traffic.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

namespace {

// Rank r's values: normal, times (r + 1), one outlier, and a run of zeros spanning a whole block.
at::Tensor quant_values(int rank, int64_t n, int64_t block) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(104729 + rank);
  at::Tensor v = at::randn({n}, gen) * (rank + 1);
  v[n / 3] = 1000.0f * (rank + 1);
  if (n > 3 * block) v.narrow(0, block, block).zero_();
  return v;
}

// Each block of `x` scaled by max|x| / `range` (a block of zeros divided by 1), each value mapped
// by `round` (a scaled value to its representable one), times the scale.
template <class Round>
at::Tensor reference_blocks(const at::Tensor& x, int64_t block, float range, Round round) {
  at::Tensor out = at::empty({x.numel()});
  auto xa = x.accessor<float, 1>();
  auto oa = out.accessor<float, 1>();
  for (int64_t b0 = 0; b0 < x.numel(); b0 += block) {
    const int64_t b1 = std::min(x.numel(), b0 + block);
    float amax = 0;
    for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(xa[i]));
    const float scale = amax / range;
    const float divisor = scale > 0 ? scale : 1.0f;
    for (int64_t i = b0; i < b1; ++i) oa[i] = round(std::max(-range, std::min(range, xa[i] / divisor))) * scale;
  }
  return out;
}

// The note's steps, rounding half to even as torch.round does.
at::Tensor reference_round_trip(const at::Tensor& x, int64_t block) {
  return reference_blocks(x, block, 127.0f, [](float y) { return std::nearbyint(y); });
}

// Design note [fp8 blocks] written out: the value of e4m3fn code c from its bit fields.
double e4m3_value(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double a = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return (c & 0x80) ? -a : a;
}

// Scale max|x| / 448, every value replaced by the nearest e4m3fn value (over all 254 codes that
// are numbers, ties to the even code).
at::Tensor reference_fp8_round_trip(const at::Tensor& x, int64_t block) {
  return reference_blocks(x, block, 448.0f, [](float y) {
    int best = 0;
    for (int c = 0; c < 256; ++c) {
      if ((c & 0x7f) == 0x7f) continue;  // NaN
      const double d = std::fabs(e4m3_value(c) - y), db = std::fabs(e4m3_value(best) - y);
      if (d < db || (d == db && c % 2 == 0 && best % 2 == 1)) best = c;
    }
    return static_cast<float>(e4m3_value(best));
  });
}

}  // namespace

TEST(QuantizedBlocks, Fp8IsTheNearestE4m3ValueTiesToEvenWithinItsRelativeBound) {
  const at::Tensor table = comm::fp8_values();
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(table[c].item<float>())) << c;
    } else {
      EXPECT_EQ(table[c].item<float>(), static_cast<float>(e4m3_value(c))) << c;
    }
  }
  EXPECT_EQ(table[0x7e].item<float>(), 448.0f);
  EXPECT_EQ(table[0x38].item<float>(), 1.0f);
  EXPECT_EQ(table[0x01].item<float>(), std::ldexp(1.0f, -9));
  const comm::QuantFormat fp8 = comm::QuantFormat::Fp8;
  const int64_t block = 64, n = 1001;
  const at::Tensor x = quant_values(1, n, block);
  at::Tensor back = at::empty({1, n});
  comm::dequantize_blocks(comm::quantize_blocks(x.view({1, n}), block, fp8), block, back, fp8);
  EXPECT_TRUE(at::equal(back.view({-1}), reference_fp8_round_trip(x, block)))
      << "max diff " << (back.view({-1}) - reference_fp8_round_trip(x, block)).abs().max().item<float>();
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min(block, n - b0);
    const at::Tensor xb = x.narrow(0, b0, len), err = (back.view({-1}).narrow(0, b0, len) - xb).abs();
    const float scale = xb.abs().max().item<float>() / 448.0f;
    // Normal codes: half a step of 3 mantissa bits, |x| / 16; subnormal ones: scale x 2^-10.
    const at::Tensor bound = at::maximum(xb.abs() / 16.0f, at::full_like(xb, scale / 1024.0f)) * (1 + 1e-5f) + 1e-30f;
    EXPECT_TRUE((err <= bound).all().item<bool>()) << "block at " << b0;
  }
  // Ties: with max|x| = 448 the scale is 1; 1.0625 lies halfway between 1 (0x38, even) and
  // 1.125 (0x39), 1.1875 between 1.125 and 1.25 (0x3a, even), -3.125 between -3 (0xc4, even) and -3.25.
  at::Tensor ties = at::tensor({448.0f, 1.0625f, 1.1875f, -3.125f, 0.0f, -0.0f});
  at::Tensor tied = at::empty({1, 6});
  comm::dequantize_blocks(comm::quantize_blocks(ties.view({1, 6}), 64, fp8), 64, tied, fp8);
  EXPECT_TRUE(at::equal(tied.view({-1}), at::tensor({448.0f, 1.0f, 1.25f, -3.0f, 0.0f, 0.0f}))) << tied;
}

TEST(QuantizedBlocks, RoundTripIsWithinEachBlocksBound) {
  const int64_t block = 64, n = 1001;
  const at::Tensor x = quant_values(2, n, block);
  at::Tensor back = at::empty({1, n});
  comm::dequantize_blocks(comm::quantize_blocks(x.view({1, n}), block), block, back);
  EXPECT_TRUE(at::equal(back.view({-1}), reference_round_trip(x, block)));
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min(block, n - b0);
    const float amax = x.narrow(0, b0, len).abs().max().item<float>();
    const float err = (back.view({-1}).narrow(0, b0, len) - x.narrow(0, b0, len)).abs().max().item<float>();
    EXPECT_LE(err, amax / 254.0f * (1 + 1e-5f) + 1e-30f) << "block at " << b0;
  }
  EXPECT_EQ(comm::quantized_bytes(n, block), 16 * (64 + 4));
  EXPECT_THROW(comm::quantize_blocks(x.view({1, n}), 6), c10::Error);  // (not a multiple of 4)
  EXPECT_THROW(comm::quantize_blocks(x.view({1, n}).to(at::kInt), 64), c10::Error);
}

class QuantizedCollectives : public ::testing::TestWithParam<int> {};

TEST_P(QuantizedCollectives, EqualTheirFormulaAndSendAQuarterOfFp32sBytes) {
  const int world = GetParam();
  const int64_t block = 256, n = 1001, part = 337;  // (neither a multiple of the block)
  std::mutex mu;
  int64_t quantized_bytes = 0, fp32_bytes = 0;
  run_ranks(world, [&](comm::ProcessGroup& pg) {
    auto counted = [&pg] { return dtrain::testing::traffic_at_rest(pg).ring_bytes_sent; };
    // All-gather: every rank's values, each quantized by its owner, on every rank (bf16 output too).
    const int64_t b0 = counted();
    at::Tensor gathered = at::empty({world * n});
    comm::quantized_all_gather(pg, gathered, quant_values(pg.rank(), n, block));
    const int64_t b1 = counted();
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(gathered.narrow(0, r * n, n), reference_round_trip(quant_values(r, n, block), block)))
          << "rank " << pg.rank() << ": part of rank " << r;
    }
    at::Tensor fp32 = at::empty({world * n});
    comm::all_gather(pg, fp32, quant_values(pg.rank(), n, block));
    const int64_t b2 = counted();
    at::Tensor narrow = at::empty({world * n}, at::kBFloat16);
    comm::quantized_all_gather(pg, narrow, quant_values(pg.rank(), n, block).to(at::kBFloat16));
    at::Tensor expected = reference_round_trip(quant_values(0, n, block).to(at::kBFloat16).to(at::kFloat), block);
    EXPECT_TRUE(at::equal(narrow.narrow(0, 0, n), expected.to(at::kBFloat16)));

    // Reduce-scatter: rank d receives every sender's part d quantized by the sender, summed in
    // fp32 in rank order, then / W.
    for (const comm::ReduceOp op : {comm::ReduceOp::Avg, comm::ReduceOp::Sum}) {
      at::Tensor mine = at::empty({part});
      comm::quantized_reduce_scatter(pg, mine, quant_values(pg.rank(), world * part, block),
                                     comm::QuantizedOptions().op(op));
      at::Tensor want = at::zeros({part});
      for (int r = 0; r < world; ++r) {
        want += reference_round_trip(quant_values(r, world * part, block).narrow(0, pg.rank() * part, part).contiguous(),
                                     block);
      }
      if (op == comm::ReduceOp::Avg) want.div_(world);
      EXPECT_TRUE(at::allclose(mine, want, 0, 0)) << "rank " << pg.rank() << " " << comm::to_string(op)
                                                  << ": max diff " << (mine - want).abs().max().item<float>();
    }
    // All-reduce (mean): the tensor padded to W parts of ceil(n / W); part d reduced as above, then
    // quantized again by its owner d for the all-gather. A group of one leaves it as it is.
    at::Tensor reduced = quant_values(pg.rank(), n, block);
    comm::quantized_all_reduce(pg, reduced);
    const int64_t chunk = (n + world - 1) / world;
    at::Tensor want_all = at::zeros({world * chunk});
    for (int d = 0; d < world; ++d) {
      at::Tensor acc = at::zeros({chunk});
      for (int r = 0; r < world; ++r) {
        at::Tensor padded = at::zeros({world * chunk});
        padded.narrow(0, 0, n).copy_(quant_values(r, n, block));
        acc += reference_round_trip(padded.narrow(0, d * chunk, chunk).contiguous(), block);
      }
      acc.div_(world);
      want_all.narrow(0, d * chunk, chunk).copy_(reference_round_trip(acc, block));
    }
    if (world == 1) want_all = quant_values(0, n, block);  // (nothing travels: untouched)
    EXPECT_TRUE(at::equal(reduced, want_all.narrow(0, 0, n)))
        << "rank " << pg.rank() << ": all-reduce, max diff " << (reduced - want_all.narrow(0, 0, n)).abs().max().item<float>();
    // Refused: sizes that do not split, an op it cannot do.
    at::Tensor odd = at::empty({part});
    if (world > 1) {
      EXPECT_THROW(comm::quantized_reduce_scatter(pg, odd, at::zeros({world * part + 1})), c10::Error);
    }
    EXPECT_THROW(comm::quantized_reduce_scatter(pg, odd, at::zeros({world * part}), comm::QuantizedOptions().op(comm::ReduceOp::Max)),
                 c10::Error);
    if (pg.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      quantized_bytes = b1 - b0;
      fp32_bytes = b2 - b1;
    }
  });
  if (world > 1) {
    // 4 blocks of (256 + 4) bytes against 1001 x 4: 3.85x fewer (3.94x for sizes a multiple of the block).
    EXPECT_NEAR(static_cast<double>(fp32_bytes) / static_cast<double>(quantized_bytes), 4004.0 / 1040.0, 1e-9)
        << quantized_bytes << " bytes against fp32's " << fp32_bytes;
  }
}

INSTANTIATE_TEST_SUITE_P(World, QuantizedCollectives, ::testing::Values(1, 2, 3));

// fp8 (Design note [fp8 blocks]) through the all-gather and the all-reduce at W = 3: every
// owner's values by the fp8 formula, the same bytes as int8.
TEST(QuantizedCollectives, Fp8GathersAndReducesByItsFormula) {
  const int world = 3;
  const int64_t block = 256, n = 1001;
  const auto fp8 = comm::QuantizedOptions().format(comm::QuantFormat::Fp8);
  run_ranks(world, [&](comm::ProcessGroup& pg) {
    const int64_t b0 = dtrain::testing::traffic_at_rest(pg).ring_bytes_sent;
    at::Tensor gathered = at::empty({world * n});
    comm::quantized_all_gather(pg, gathered, quant_values(pg.rank(), n, block), fp8);
    // (the counters are the process's: every rank's (W - 1) parts of int8's size)
    EXPECT_EQ(dtrain::testing::traffic_at_rest(pg).ring_bytes_sent - b0,
              world * (world - 1) * comm::quantized_bytes(n, block));
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(at::equal(gathered.narrow(0, r * n, n), reference_fp8_round_trip(quant_values(r, n, block), block)))
          << "rank " << pg.rank() << ": part of rank " << r;
    }
    at::Tensor reduced = quant_values(pg.rank(), n, block);
    comm::quantized_all_reduce(pg, reduced, fp8);
    const int64_t chunk = (n + world - 1) / world;
    at::Tensor want = at::zeros({world * chunk});
    for (int d = 0; d < world; ++d) {
      at::Tensor acc = at::zeros({chunk});
      for (int r = 0; r < world; ++r) {
        at::Tensor padded = at::zeros({world * chunk});
        padded.narrow(0, 0, n).copy_(quant_values(r, n, block));
        acc += reference_fp8_round_trip(padded.narrow(0, d * chunk, chunk).contiguous(), block);
      }
      want.narrow(0, d * chunk, chunk).copy_(reference_fp8_round_trip(acc.div_(world), block));
    }
    EXPECT_TRUE(at::equal(reduced, want.narrow(0, 0, n))) << "rank " << pg.rank();
  });
}

// Two levels (the note): 4 ranks on 2 nodes, laid out contiguously ({0, 0, 1, 1}) and interleaved
// ({0, 1, 0, 1}); rank d ends with sum over nodes a of RT(sum over a's ranks s of RT(x_s[d])),
// the inner sum made by the rank of node a with d's local index; across nodes each rank sends one
// quantized part (the flat all-to-all: two). A group on one node, or with uneven nodes, stays flat.
// Tensors of several slices (the CPU path works 64K values at a time over all the rows:
// comm/quantized.cpp), blocks of 4: the round trip (4 slices of one row), the all-gather and the
// reduce-scatter at W = 5 (3 slices of five rows; the sums in rank order past four ranks), the
// two-level reduce-scatter (2 slices of four rows), each against its formula to the bit.
TEST(QuantizedCollectives, TensorsOfSeveralSlicesEqualTheirFormula) {
  const int64_t block = 4;
  const at::Tensor x = quant_values(3, 200003, block);
  at::Tensor back = at::empty({1, x.numel()});
  comm::dequantize_blocks(comm::quantize_blocks(x.view({1, -1}), block), block, back);
  EXPECT_TRUE(at::equal(back.view({-1}), reference_round_trip(x, block)));
  const int64_t n = 30001, part = 30001;
  auto sum_of_parts = [&](int d, const std::vector<int>& senders, int world) {
    at::Tensor want = at::zeros({part});
    for (int r : senders) {
      want += reference_round_trip(quant_values(r, world * part, block).narrow(0, d * part, part).contiguous(), block);
    }
    return want;
  };
  run_ranks(5, [&](comm::ProcessGroup& pg) {
    at::Tensor gathered = at::empty({5 * n});
    comm::quantized_all_gather(pg, gathered, quant_values(pg.rank(), n, block), comm::QuantizedOptions().block(block));
    for (int r = 0; r < 5; ++r) {
      EXPECT_TRUE(at::equal(gathered.narrow(0, r * n, n), reference_round_trip(quant_values(r, n, block), block))) << r;
    }
    at::Tensor mine = at::empty({part});
    comm::quantized_reduce_scatter(pg, mine, quant_values(pg.rank(), 5 * part, block),
                                   comm::QuantizedOptions().block(block).op(comm::ReduceOp::Sum));
    EXPECT_TRUE(at::equal(mine, sum_of_parts(pg.rank(), {0, 1, 2, 3, 4}, 5))) << "rank " << pg.rank();
  });
  run_ranks(
      4,
      [&](comm::ProcessGroup& pg) {
        at::Tensor mine = at::empty({part});
        comm::quantized_reduce_scatter(pg, comm::split_by_node(pg), mine, quant_values(pg.rank(), 4 * part, block),
                                       comm::QuantizedOptions().block(block).op(comm::ReduceOp::Sum));
        at::Tensor want = reference_round_trip(sum_of_parts(pg.rank(), {0, 1}, 4), block);
        want += reference_round_trip(sum_of_parts(pg.rank(), {2, 3}, 4), block);
        EXPECT_TRUE(at::equal(mine, want)) << "rank " << pg.rank();
      },
      20000, {0, 0, 1, 1});
}

TEST(QuantizedCollectives, TwoLevelReduceScatterEqualsItsFormulaAndCrossesOncePerNode) {
  const int64_t block = 256, part = 337;
  for (const std::vector<int>& nodes : {std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 1, 0, 1}}) {
    SCOPED_TRACE(::testing::PrintToString(nodes));
    const int world = 4;
    std::mutex mu;
    comm::Traffic before, after;
    run_ranks(
        world,
        [&](comm::ProcessGroup& pg) {
          const comm::NodeGroups g = comm::split_by_node(pg);
          ASSERT_TRUE(g.two_level());
          EXPECT_EQ(g.within.size(), 2);
          EXPECT_EQ(g.across.size(), 2);
          const comm::Traffic t0 = dtrain::testing::traffic_at_rest(pg);
          if (pg.rank() == 0) before = t0;
          at::Tensor mine = at::empty({part});
          comm::quantized_reduce_scatter(pg, g, mine, quant_values(pg.rank(), world * part, block));
          const comm::Traffic t1 = dtrain::testing::traffic_at_rest(pg);
          if (pg.rank() == 0) after = t1;
          at::Tensor want = at::zeros({part});
          for (int a : {nodes[0], 1 - nodes[0]}) {  // (nodes in order of first appearance)
            at::Tensor inner = at::zeros({part});
            for (int s = 0; s < world; ++s) {
              if (nodes[s] != a) continue;
              inner += reference_round_trip(
                  quant_values(s, world * part, block).narrow(0, pg.rank() * part, part).contiguous(), block);
            }
            want += reference_round_trip(inner, block);
          }
          want.div_(world);
          EXPECT_TRUE(at::equal(mine, want)) << "rank " << pg.rank() << ": max diff "
                                             << (mine - want).abs().max().item<float>();
        },
        20000, nodes);
    // Across: each rank sends the other node one quantized part of 337 values: 2 blocks of 260 bytes.
    EXPECT_EQ(after.across_nodes_sent - before.across_nodes_sent, 4 * 2 * 260);
  }
  run_ranks(
      4,
      [](comm::ProcessGroup& pg) {
        EXPECT_FALSE(comm::split_by_node(pg).two_level());  // (uneven: 3 + 1)
      },
      20000, {0, 0, 0, 1});
  run_ranks(2, [](comm::ProcessGroup& pg) { EXPECT_FALSE(comm::split_by_node(pg).two_level()); });  // (one node)
}
