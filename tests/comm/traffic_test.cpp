// comm::traffic(): payload per kind and the bytes a ring algorithm sends, counted per call (threads
// over one store share the process's counters, so both ranks' calls add up here).
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/comm.h"
#include "dtrain/comm/traffic.h"
#include "testing/testing.h"

using namespace dtrain;

TEST(Traffic, CountsPayloadAndRingBytesPerKind) {
  const comm::Traffic before = comm::traffic();
  dtrain::testing::run_ranks(2, [](comm::ProcessGroup& pg) {
    at::Tensor t = at::ones({1000});  // 4000 bytes
    comm::all_reduce(pg, t);
    at::Tensor out = at::empty({2000});
    comm::all_gather(pg, out, t);     // output 8000 bytes
    at::Tensor part = at::empty({500});
    comm::reduce_scatter(pg, part, t);  // input 4000 bytes
  });
  const comm::Traffic after = comm::traffic();
  EXPECT_EQ(after.all_reduce - before.all_reduce, 2 * 4000);
  EXPECT_EQ(after.all_gather - before.all_gather, 2 * 8000);
  EXPECT_EQ(after.reduce_scatter - before.reduce_scatter, 2 * 4000);
  // Per rank: all-reduce 2 (n-1)/n x 4000 = 4000, all-gather 1/2 x 8000, reduce-scatter 1/2 x 4000.
  EXPECT_EQ(after.ring_bytes_sent - before.ring_bytes_sent, 2 * (4000 + 4000 + 2000));
  EXPECT_EQ(after.calls - before.calls, 6);
}

// Two "nodes" of two ranks (0, 1 | 2, 3): the ring's successor decides where a rank's bytes go,
// an all-to-all splits them by peer (uneven splits exactly), a send by its destination; subgroups know their members'
// nodes and count under their labels.
TEST(Traffic, SplitsWithinAndAcrossNodesAndByGroup) {
  std::mutex mu;
  std::vector<comm::Traffic> seen(5);
  std::vector<std::vector<int>> nodes_seen(4);
  const comm::Traffic before = comm::traffic();
  dtrain::testing::run_ranks(
      4,
      [&](comm::ProcessGroup& pg) {
        auto counted = [&pg] { return dtrain::testing::traffic_at_rest(pg); };
        // (each rank's own counts are not separable here: the counters are the process's; the sums are checked)
        const comm::Traffic t0 = counted();
        at::Tensor t = at::ones({1000});  // 4000 bytes: each rank sends 2 x 3/4 x 4000 = 6000
        comm::all_reduce(pg, t);
        const comm::Traffic t1 = counted();
        at::Tensor out = at::empty({4, 100});
        comm::all_to_all(pg, out, at::ones({4, 100}));  // 1600 bytes: 400 to each of 3 peers
        const comm::Traffic t2 = counted();
        // Uneven: rank r sends j + 1 rows of 400 bytes to rank j (its own r + 1 stay).
        at::Tensor rows = at::empty({4 * (pg.rank() + 1), 100});
        comm::all_to_all(pg, rows, at::ones({10, 100}),
                         comm::AllToAllOptions().input_split_sizes({1, 2, 3, 4}).output_split_sizes(
                             std::vector<int64_t>(4, pg.rank() + 1)));
        const comm::Traffic t2b = counted();
        // Within each node (label "shard") and across (label "replicate"): 2 ranks, 4000 bytes each.
        comm::ProcessGroup shard = pg.split({{0, 1}, {2, 3}}, "shard");
        comm::ProcessGroup replicate = pg.split({{0, 2}, {1, 3}}, "replicate");
        comm::all_reduce(shard, t);
        comm::all_reduce(replicate, t);
        if (pg.rank() == 0) comm::send(pg, t, 2);
        if (pg.rank() == 2) comm::recv(pg, t, 0);
        const comm::Traffic t3 = counted();
        std::lock_guard<std::mutex> lock(mu);
        nodes_seen[pg.rank()] = replicate.member_nodes();
        if (pg.rank() == 0) {
          seen[0] = t0;
          seen[1] = t1;
          seen[2] = t2;
          seen[3] = t2b;
          seen[4] = t3;
        }
      },
      20000, {0, 0, 1, 1});
  EXPECT_EQ(nodes_seen[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(nodes_seen[3], (std::vector<int>{0, 1}));
  // All-reduce: ranks 1 and 3 have their successor on the other node: 2 of 4 x 6000.
  EXPECT_EQ(seen[1].ring_bytes_sent - seen[0].ring_bytes_sent, 4 * 6000);
  EXPECT_EQ(seen[1].across_nodes_sent - seen[0].across_nodes_sent, 2 * 6000);
  // All-to-all: each rank sends 1200, two of its three peers away: 800 across each.
  EXPECT_EQ(seen[2].ring_bytes_sent - seen[1].ring_bytes_sent, 4 * 1200);
  EXPECT_EQ(seen[2].across_nodes_sent - seen[1].across_nodes_sent, 4 * 800);
  // Uneven all-to-all, exactly: ranks send (9 + 8 + 7 + 6) rows to the others; ranks 0 and 1 send
  // 3 + 4 rows to the other node, ranks 2 and 3 send 1 + 2.
  EXPECT_EQ(seen[3].ring_bytes_sent - seen[2].ring_bytes_sent, (9 + 8 + 7 + 6) * 400);
  EXPECT_EQ(seen[3].across_nodes_sent - seen[2].across_nodes_sent, (2 * 7 + 2 * 3) * 400);
  EXPECT_EQ(seen[3].all_to_all - seen[2].all_to_all, 4 * 4000);  // (the payload: each rank's input)
  // Shard groups (within a node) 4 x 4000 within; replicate groups 4 x 4000 across; the send 4000 across.
  EXPECT_EQ(seen[4].across_nodes_sent - seen[3].across_nodes_sent, 4 * 4000 + 4000);
  auto group = [](const comm::Traffic& t, const std::string& label) {
    const auto it = t.by_group.find(label);
    return it == t.by_group.end() ? comm::Traffic::Group{} : it->second;
  };
  EXPECT_EQ(group(seen[4], "shard").sent - group(before, "shard").sent, 4 * 4000);
  EXPECT_EQ(group(seen[4], "shard").across_nodes - group(before, "shard").across_nodes, 0);
  EXPECT_EQ(group(seen[4], "replicate").sent - group(before, "replicate").sent, 4 * 4000);
  EXPECT_EQ(group(seen[4], "replicate").across_nodes - group(before, "replicate").across_nodes, 4 * 4000);
}
