// The two-level all-reduce (Design note [two-level all-reduce], comm/two_level.h) against the flat
// all-reduce, and its bytes across nodes.
#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>

#include "dtrain/comm.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/comm/two_level.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;

// The two-level all-reduce (Design note [two-level all-reduce], comm/two_level.h) on 4 ranks of two
// nodes, contiguous and interleaved: integer values (every order of summing gives the same sum),
// so it equals the flat all-reduce exactly, sum and mean, for a size that does not split in two.
// Across nodes each rank sends its part of B / 2 once (an all-reduce over the two nodes): 4 x 2,004
// bytes of the 1,001-value fp32 tensor, against the flat ring's 2 (or, interleaved, 4) crossing
// ranks x 6,006. Uneven nodes: the flat all-reduce.
TEST(TwoLevelAllReduce, EqualsTheFlatSumAndCrossesOncePerNode) {
  const int64_t n = 1001;
  auto values = [n](int rank) { return at::arange(n, at::kFloat).remainder(97).mul(rank + 1).sub(40); };
  for (const std::vector<int>& nodes : {std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 1, 0, 1}}) {
    SCOPED_TRACE(::testing::PrintToString(nodes));
    std::vector<int64_t> across(2, 0);
    run_ranks(
        4,
        [&](comm::ProcessGroup& pg) {
          const comm::NodeGroups g = comm::split_by_node(pg);
          ASSERT_TRUE(g.two_level());
          at::Tensor want = values(0) + values(1) + values(2) + values(3);
          const int64_t a0 = dtrain::testing::traffic_at_rest(pg).across_nodes_sent;
          at::Tensor t = values(pg.rank());
          comm::two_level_all_reduce(pg, g, t);
          const int64_t a1 = dtrain::testing::traffic_at_rest(pg).across_nodes_sent;
          at::Tensor flat = values(pg.rank());
          comm::all_reduce(pg, flat);
          const int64_t a2 = dtrain::testing::traffic_at_rest(pg).across_nodes_sent;
          EXPECT_TRUE(at::equal(t, want)) << "rank " << pg.rank();
          EXPECT_TRUE(at::equal(flat, want)) << "rank " << pg.rank();
          at::Tensor mean = values(pg.rank());
          comm::two_level_all_reduce(pg, g, mean, comm::AllReduceOptions().op(comm::ReduceOp::Avg));
          EXPECT_TRUE(at::equal(mean, want / 4)) << "rank " << pg.rank();
          if (pg.rank() == 0) {
            across[0] = a1 - a0;
            across[1] = a2 - a1;
          }
        },
        20000, nodes);
    EXPECT_EQ(across[0], 4 * 501 * 4);
    EXPECT_EQ(across[1], (nodes[1] == 0 ? 2 : 4) * 6006);
  }
  run_ranks(
      4,
      [&](comm::ProcessGroup& pg) {
        const comm::NodeGroups g = comm::split_by_node(pg);  // (3 + 1: not two levels)
        at::Tensor t = values(pg.rank());
        comm::two_level_all_reduce(pg, g, t);
        EXPECT_TRUE(at::equal(t, values(0) + values(1) + values(2) + values(3)));
      },
      20000, {0, 0, 0, 1});
}

// The across level as a stage (Design note [two-level all-reduce]: comm::Work::staged): launched
// async, the work has sent nothing across; advance() waits for the in-node level and starts the
// across one (its bytes counted at once, before any wait); wait() finishes the gather; the result
// is the flat sum. A work advanced past its last stage, and a flat one, ignore advance().
TEST(TwoLevelAllReduce, AdvanceStartsTheAcrossLevelBeforeTheWait) {
  const int64_t n = 1001;
  auto values = [n](int rank) { return at::arange(n, at::kFloat).remainder(97).mul(rank + 1).sub(40); };
  std::vector<int64_t> across(3, -1);
  run_ranks(
      4,
      [&](comm::ProcessGroup& pg) {
        const comm::NodeGroups g = comm::split_by_node(pg);
        auto crossed = [&pg] { return dtrain::testing::traffic_at_rest(pg).across_nodes_sent; };
        comm::barrier(pg);
        const int64_t a0 = crossed();
        at::Tensor t = values(pg.rank());
        comm::Work w = comm::two_level_all_reduce(pg, g, t, comm::AllReduceOptions().async_op(true));
        comm::barrier(pg);  // (every rank launched; nobody advanced)
        const int64_t a1 = crossed();
        comm::barrier(pg);  // (every rank read it)
        w.advance();
        comm::barrier(pg);  // (every rank advanced)
        const int64_t a2 = crossed();
        w.advance();
        w.advance();  // (no stage left)
        w.wait();
        EXPECT_TRUE(at::equal(t, values(0) + values(1) + values(2) + values(3))) << "rank " << pg.rank();
        if (pg.rank() == 0) across = {a0, a1, a2};
      },
      20000, {0, 0, 1, 1});
  EXPECT_EQ(across[1], across[0]) << "the across level started before advance()";
  EXPECT_GE(across[2] - across[0], 2 * 2004) << "advance() did not start the across level";
}
