// comm::traffic(): payload per kind and the bytes a ring algorithm sends, counted per call (threads
// over one store share the process's counters, so both ranks' calls add up here).
#include <gtest/gtest.h>

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
