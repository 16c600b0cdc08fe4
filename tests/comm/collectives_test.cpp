// Collectives over real Gloo process groups, one thread per rank, world sizes 1..4.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "dtrain/comm.h"
#include "testing/testing.h"

using namespace dtrain::comm;
using dtrain::testing::run_ranks;

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduceOps) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    auto base = at::arange(10, at::kFloat);
    auto t = base * (r + 1);
    all_reduce(pg, t);
    const float tri = W * (W + 1) / 2.0f;
    EXPECT_TRUE(at::allclose(t, base * tri)) << "sum";
    t = base * (r + 1);
    all_reduce(pg, t, AllReduceOptions().op(ReduceOp::Avg));
    EXPECT_TRUE(at::allclose(t, base * tri / W)) << "avg";
    t = base * (r + 1);
    all_reduce(pg, t, AllReduceOptions().op(ReduceOp::Max));
    EXPECT_TRUE(at::allclose(t, base * W)) << "max";
    t = base * (r + 1);
    all_reduce(pg, t, AllReduceOptions().op(ReduceOp::Min));
    EXPECT_TRUE(at::allclose(t, base)) << "min";
    // Integer sum, asynchronous.
    auto i = at::full({7}, r, at::kLong);
    Work w = all_reduce(pg, i, AllReduceOptions().async_op(true));
    w.wait();
    w.wait();  // idempotent
    EXPECT_TRUE(at::equal(i, at::full({7}, W * (W - 1) / 2, at::kLong)));
  });
}

TEST_P(Collectives, Broadcast) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int src = W - 1;
    auto t = at::full({5, 3}, pg.rank(), at::kDouble);
    broadcast(pg, t, BroadcastOptions().src(src));
    EXPECT_TRUE(at::equal(t, at::full({5, 3}, src, at::kDouble)));
    // Coalesced, mixed dtypes and a bucket limit smaller than one tensor.
    std::vector<at::Tensor> ts{at::full({100}, pg.rank(), at::kFloat), at::full({3}, pg.rank(), at::kLong),
                               at::full({2, 2}, pg.rank() + 0.5, at::kFloat), at::empty({0})};
    broadcast_coalesced(pg, ts, 0, 64);
    EXPECT_TRUE(at::equal(ts[0], at::zeros({100})));
    EXPECT_TRUE(at::equal(ts[1], at::zeros({3}, at::kLong)));
    EXPECT_TRUE(at::equal(ts[2], at::full({2, 2}, 0.5)));
  });
}

TEST_P(Collectives, AllGatherEvenAndUneven) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    auto in = at::arange(4, at::kFloat) + 10 * r;
    auto out = at::empty({4 * W});
    all_gather(pg, out, in);
    std::vector<at::Tensor> expect;
    for (int q = 0; q < W; ++q) expect.push_back(at::arange(4, at::kFloat) + 10 * q);
    EXPECT_TRUE(at::equal(out, at::cat(expect)));

    // Uneven: rank q contributes q + 1 elements (and some ranks none when 7 over 3... below).
    std::vector<int64_t> counts;
    for (int q = 0; q < W; ++q) counts.push_back(q + 1);
    auto in2 = at::full({r + 1}, r, at::kFloat);
    auto out2 = at::empty({W * (W + 1) / 2});
    Work w = all_gather(pg, out2, in2, AllGatherOptions().counts(counts).async_op(true));
    w.wait();
    std::vector<at::Tensor> expect2;
    for (int q = 0; q < W; ++q) expect2.push_back(at::full({q + 1}, q, at::kFloat));
    EXPECT_TRUE(at::equal(out2, at::cat(expect2)));

    // The split rule for sizes not divisible by W, including empty parts.
    auto parts = even_split(2, W);
    auto in3 = at::full({parts[r]}, r + 1, at::kFloat);
    auto out3 = at::empty({2});
    all_gather(pg, out3, in3, AllGatherOptions().counts(parts));
    EXPECT_FLOAT_EQ(out3[0].item<float>(), 1.0f);
    EXPECT_FLOAT_EQ(out3[1].item<float>(), W >= 2 ? 2.0f : 1.0f);
  });
}

TEST_P(Collectives, ReduceScatterUneven) {
  const int W = GetParam();
  for (int64_t n : {int64_t(12), int64_t(7), int64_t(2), int64_t(1)}) {
    run_ranks(W, [&](ProcessGroup& pg) {
      const int r = pg.rank();
      auto input = at::arange(n, at::kFloat) * (r + 1);
      auto counts = even_split(n, W);
      auto offsets = offsets_of(counts);
      auto expect_sum = (at::arange(n, at::kFloat) * (W * (W + 1) / 2.0)).narrow(0, offsets[r], counts[r]);
      auto out = at::empty({counts[r]});
      reduce_scatter(pg, out, input);
      EXPECT_TRUE(at::allclose(out, expect_sum)) << "n=" << n;
      out = at::empty({counts[r]});
      reduce_scatter(pg, out, input, ReduceScatterOptions().op(ReduceOp::Avg));
      EXPECT_TRUE(at::allclose(out, expect_sum / W)) << "n=" << n;
      out = at::empty({counts[r]});
      Work w = reduce_scatter(pg, out, input, ReduceScatterOptions().op(ReduceOp::Max).async_op(true));
      w.wait();
      EXPECT_TRUE(at::allclose(out, (at::arange(n, at::kFloat) * W).narrow(0, offsets[r], counts[r])));
    });
  }
}

TEST_P(Collectives, ReduceScatterExplicitCountsAndBf16) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    std::vector<int64_t> counts;
    for (int q = 0; q < W; ++q) counts.push_back(W - q);  // W, W-1, ..., 1
    const int64_t n = W * (W + 1) / 2;
    auto input = at::ones({n}, at::kBFloat16);
    auto out = at::empty({counts[r]}, at::kBFloat16);
    reduce_scatter(pg, out, input, ReduceScatterOptions().counts(counts));
    EXPECT_TRUE(at::equal(out, at::full({counts[r]}, W, at::kBFloat16)));
  });
}

// Workspaces (Design note [buffers reused], util/block_pool.h): the same results, the bytes written
// where the caller said (the all-gather's W copies of the input, the reduce-scatter's received
// parts), an uneven all-gather ignoring it, and a workspace too small refused with the sizes.
TEST_P(Collectives, WorkspacesGiveTheSameResults) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    const bool used = all_gather_uses_workspace(pg);
    EXPECT_EQ(used, W > 1) << "Gloo gathers and reduce-scatters through a workspace";
    EXPECT_EQ(reduce_scatter_uses_workspace(pg), W > 1);
    for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      auto in = (at::arange(5, at::kFloat) + 10 * r).to(dt);
      auto ws = at::full({5 * W + 3}, -1, at::TensorOptions().dtype(dt));
      auto out = at::empty({5 * W}, dt);
      all_gather(pg, out, in, AllGatherOptions().workspace(ws).async_op(true)).wait();
      std::vector<at::Tensor> expect;
      for (int q = 0; q < W; ++q) expect.push_back((at::arange(5, at::kFloat) + 10 * q).to(dt));
      EXPECT_TRUE(at::equal(out, at::cat(expect))) << dt;
      if (used) EXPECT_TRUE(at::equal(ws.narrow(0, 0, 5 * W).view({W, 5}), in.expand({W, 5}))) << dt;

      auto input = (at::arange(4 * W, at::kFloat) * (r + 1)).to(dt);
      auto rs_ws = at::full({4 * W}, -1, at::TensorOptions().dtype(dt));
      auto part = at::empty({4}, dt);
      reduce_scatter(pg, part, input, ReduceScatterOptions().op(ReduceOp::Avg).workspace(rs_ws));
      const auto expect_avg = (at::arange(4 * W, at::kFloat) * ((W + 1) / 2.0)).narrow(0, 4 * r, 4);
      EXPECT_TRUE(at::allclose(part.to(at::kFloat), expect_avg)) << dt;
      if (used) EXPECT_FALSE(at::equal(rs_ws, at::full({4 * W}, -1, at::TensorOptions().dtype(dt)))) << "unused workspace";
    }
    // Uneven counts: with a workspace, an all-to-all of this rank's W copies of its part (no
    // padding), the rest of the workspace untouched; the result is right.
    std::vector<int64_t> counts;
    for (int q = 0; q < W; ++q) counts.push_back(q + 1);
    auto ws = at::full({W * W}, -1.0f);
    auto out2 = at::empty({W * (W + 1) / 2});
    all_gather(pg, out2, at::full({r + 1}, r, at::kFloat), AllGatherOptions().counts(counts).workspace(ws));
    std::vector<at::Tensor> expect2;
    for (int q = 0; q < W; ++q) expect2.push_back(at::full({q + 1}, q, at::kFloat));
    EXPECT_TRUE(at::equal(out2, at::cat(expect2)));
    if (used) {
      EXPECT_TRUE(at::equal(ws.narrow(0, 0, W * (r + 1)), at::full({W * (r + 1)}, r, at::kFloat)));
      EXPECT_TRUE(at::equal(ws.narrow(0, W * (r + 1), W * W - W * (r + 1)), at::full({W * W - W * (r + 1)}, -1.0f)));
    } else {
      EXPECT_TRUE(at::equal(ws, at::full({W * W}, -1.0f)));
    }
    if (!used) return;
    auto small = at::empty({5 * W - 1});
    auto out3 = at::empty({5 * W});
    try {
      all_gather(pg, out3, at::zeros({5}), AllGatherOptions().workspace(small));
      ADD_FAILURE() << "a workspace too small was taken";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("hold at least " + std::to_string(5 * W) + " elements"), std::string::npos) << e.what();
    }
    auto part = at::empty({4});
    try {
      reduce_scatter(pg, part, at::zeros({4 * W}), ReduceScatterOptions().workspace(at::empty({4 * W}, at::kDouble)));
      ADD_FAILURE() << "a workspace of another dtype was taken";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("of the input's dtype"), std::string::npos) << e.what();
    }
  });
}

TEST_P(Collectives, Bf16AndBoolTravelBitExact) {
  // libtorch 1.13's Gloo has no bf16: movement goes as bytes, reductions in float32.
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    auto src = (at::arange(6, at::kFloat) / 3 + 100 * r).to(at::kBFloat16);
    auto b = src.clone();
    broadcast(pg, b, BroadcastOptions().src(W - 1));
    EXPECT_TRUE(at::equal(b, (at::arange(6, at::kFloat) / 3 + 100 * (W - 1)).to(at::kBFloat16)));
    auto out = at::empty({6 * W}, at::kBFloat16);
    all_gather(pg, out, src);
    for (int q = 0; q < W; ++q) {
      EXPECT_TRUE(at::equal(out.narrow(0, 6 * q, 6), (at::arange(6, at::kFloat) / 3 + 100 * q).to(at::kBFloat16)));
    }
    auto s = at::full({5}, 1.5, at::kBFloat16);
    all_reduce(pg, s, AllReduceOptions().op(ReduceOp::Avg));
    EXPECT_TRUE(at::equal(s, at::full({5}, 1.5, at::kBFloat16)));
    auto flags = at::full({3}, r % 2 == 0, at::kBool);
    auto all_flags = at::empty({3 * W}, at::kBool);
    all_gather(pg, all_flags, flags);
    EXPECT_EQ(all_flags.sum().item<int64_t>(), 3 * ((W + 1) / 2));
    auto rows = at::full({W, 2}, r, at::kBFloat16);
    auto got = at::empty({W, 2}, at::kBFloat16);
    all_to_all(pg, got, rows);
    for (int q = 0; q < W; ++q) EXPECT_TRUE(at::equal(got[q], at::full({2}, q, at::kBFloat16)));
  });
}

TEST_P(Collectives, AllToAllUneven) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    // Rank r sends (j + 1) rows of value 100 r + j to rank j.
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> rows;
    for (int j = 0; j < W; ++j) {
      in_splits.push_back(j + 1);
      rows.push_back(at::full({j + 1, 2}, 100 * r + j, at::kFloat));
      out_splits.push_back(r + 1);
    }
    auto input = at::cat(rows);
    auto output = at::empty({W * (r + 1), 2});
    all_to_all(pg, output, input, AllToAllOptions().input_split_sizes(in_splits).output_split_sizes(out_splits));
    for (int q = 0; q < W; ++q) {
      EXPECT_TRUE(at::equal(output.narrow(0, q * (r + 1), r + 1), at::full({r + 1, 2}, 100 * q + r, at::kFloat)));
    }
  });
}

TEST_P(Collectives, SendRecvRingAndBarrier) {
  const int W = GetParam();
  if (W == 1) GTEST_SKIP() << "send/recv needs two ranks";
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    auto out = at::full({3}, r, at::kFloat);
    auto in = at::empty({3});
    Work s = send(pg, out, (r + 1) % W, SendRecvOptions().tag(7).async_op(true));
    recv(pg, in, (r + W - 1) % W, SendRecvOptions().tag(7));
    s.wait();
    EXPECT_TRUE(at::equal(in, at::full({3}, (r + W - 1) % W, at::kFloat)));
    barrier(pg);
  });
}

TEST_P(Collectives, SubgroupsAndSplit) {
  const int W = GetParam();
  run_ranks(W, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    // new_group of the even ranks; odd ranks get an empty handle.
    std::vector<int> evens;
    for (int q = 0; q < W; q += 2) evens.push_back(q);
    ProcessGroup g = pg.new_group(evens);
    EXPECT_EQ(g.is_member(), r % 2 == 0);
    if (g.is_member()) {
      EXPECT_EQ(g.size(), static_cast<int>(evens.size()));
      EXPECT_EQ(g.rank(), r / 2);
      EXPECT_EQ(g.global_ranks(), evens);
      auto t = at::ones({4});
      all_reduce(pg.new_group({0}).is_member() ? g : g, t);
      EXPECT_TRUE(at::equal(t, at::full({4}, static_cast<float>(evens.size()))));
    } else {
      pg.new_group({0});  // keep the creation order identical on every rank
    }
    // A 2-D layout: consecutive pairs (shard groups) and strided (replicate groups).
    if (W % 2 == 0) {
      std::vector<std::vector<int>> pairs, strided(2);
      for (int q = 0; q < W; q += 2) pairs.push_back({q, q + 1});
      for (int q = 0; q < W; ++q) strided[q % 2].push_back(q);
      ProcessGroup shard = pg.split(pairs);
      ProcessGroup replicate = pg.split(strided);
      auto t = at::full({1}, r, at::kFloat);
      all_reduce(shard, t);
      EXPECT_EQ(t.item<float>(), (r / 2) * 4 + 1);  // q + q + 1 for the pair starting at q
      auto u = at::ones({1});
      all_reduce(replicate, u);
      EXPECT_EQ(u.item<float>(), W / 2);
      EXPECT_NE(shard.describe().find("group"), std::string::npos);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(Split, EvenSplitRule) {
  EXPECT_EQ(even_split(7, 3), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(even_split(2, 3), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(even_split(0, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(offsets_of({3, 2, 2}), (std::vector<int64_t>{0, 3, 5, 7}));
  EXPECT_THROW(even_split(3, 0), c10::Error);
}
