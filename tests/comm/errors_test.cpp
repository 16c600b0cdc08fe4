// Bad input and failing peers give errors that name the rank, the operation and the cause.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include <ATen/ATen.h>

#include "dtrain/comm.h"
#include "testing/testing.h"

using namespace dtrain::comm;
using dtrain::testing::error_of;
using dtrain::testing::run_ranks;

TEST(CommErrors, LocalSizeChecksNameRankAndOperation) {
  run_ranks(2, [](ProcessGroup& pg) {
    if (pg.rank() != 1) return;
    auto in = at::ones({4});
    auto wrong = at::empty({7});
    auto msg = error_of([&] { all_gather(pg, wrong, in); });
    EXPECT_NE(msg.find("[dtrain rank 1/2] all_gather"), std::string::npos) << msg;
    EXPECT_NE(msg.find("output has 7 elements"), std::string::npos) << msg;
    auto out = at::empty({5});
    msg = error_of([&] { reduce_scatter(pg, out, in); });
    EXPECT_NE(msg.find("reduce_scatter"), std::string::npos) << msg;
    EXPECT_NE(msg.find("this rank's part has 2"), std::string::npos) << msg;
    auto strided = at::ones({4, 4}).t();
    msg = error_of([&] { all_reduce(pg, strided); });
    EXPECT_NE(msg.find("contiguous"), std::string::npos) << msg;
    auto ints = at::ones({2}, at::kLong);
    msg = error_of([&] { all_reduce(pg, ints, AllReduceOptions().op(ReduceOp::Avg)); });
    EXPECT_NE(msg.find("floating-point"), std::string::npos) << msg;
    msg = error_of([&] { broadcast(pg, in, BroadcastOptions().src(5)); });
    EXPECT_NE(msg.find("src 5"), std::string::npos) << msg;
  });
}

TEST(CommErrors, TimeoutNamesTheOperation) {
  // Rank 1 never joins the all_reduce: rank 0 must fail after the timeout, not hang.
  std::string msg;
  std::atomic<bool> rank0_done{false};
  run_ranks(
      2,
      [&](ProcessGroup& pg) {
        if (pg.rank() == 0) {
          auto t = at::ones({3});
          msg = error_of([&] { all_reduce(pg, t); });
          rank0_done = true;
        } else {
          while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      },
      1500);
  EXPECT_NE(msg.find("[dtrain rank 0/2] all_reduce(sum, 3 x Float) failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
}

TEST(CommErrors, DebugModeReportsMismatchedSizesByRank) {
  ::setenv("DTRAIN_DEBUG", "1", 1);
  std::vector<std::string> msgs(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    auto t = at::ones({pg.rank() == 0 ? 10 : 12});
    msgs[pg.rank()] = error_of([&] { all_reduce(pg, t); });
  });
  ::unsetenv("DTRAIN_DEBUG");
  EXPECT_NE(msgs[0].find("rank 1 called a different collective or sizes"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[1].find("rank 0 called a different collective or sizes"), std::string::npos) << msgs[1];
  EXPECT_NE(msgs[1].find("[dtrain rank 1/2] all_reduce"), std::string::npos) << msgs[1];
}

TEST(CommErrors, BadSplitIsRejected) {
  run_ranks(3, [](ProcessGroup& pg) {
    auto msg = error_of([&] { pg.split({{0, 1}, {1, 2}}); });
    EXPECT_NE(msg.find("appears more than once"), std::string::npos) << msg;
  });
}

TEST(CommErrors, PeerDeathIsReportedNotHung) {
  // Two real processes over a FileStore; rank 1 exits after init, rank 0's all_reduce must fail
  // quickly and say that a peer closed its connection.
  const std::string dir = dtrain::testing::temp_dir();
  const std::string w = dtrain::testing::bin("comm_test_worker");
  auto res = dtrain::testing::run_command(
      w + " peer-death 1 2 " + dir + "/store & " + w + " peer-death 0 2 " + dir + "/store; s=$?; wait; exit $s",
      60);
  EXPECT_EQ(res.exit_code, 3) << res.output;
  EXPECT_NE(res.output.find("[dtrain rank 0/2] all_reduce"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("peer closed its connection"), std::string::npos) << res.output;
}

namespace {
// Arms `g`'s abort signal and raises it ("the test aborts it") from another thread 200 ms later.
std::thread raise_after_200ms(const ProcessGroup& g) {
  g.abort_signal()->arm();
  return std::thread([signal = g.abort_signal()] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    signal->abort("the test aborts it");
  });
}
}  // namespace

TEST(CommErrors, AnAbortedGroupIsDroppedWithoutWaitingForItsOperation) {
  // Design note [aborting a group's waits] (comm/abort.h): rank 0's all_reduce is aborted while
  // rank 1, alive, never joins it; Gloo's thread still waits for rank 1 until the 20-s timeout.
  // Dropping rank 0's last handles (as a rank left out of an elastic job does when it exits, or the
  // members when they drop the old plan's subgroups) must not wait with it.
  std::atomic<bool> dropped{false};
  double seconds = -1;
  std::string msg;
  run_ranks(2, [&](ProcessGroup& pg) {
    ProcessGroup sub = pg.new_group({0, 1});
    if (pg.rank() == 1) {  // (keeps its connections open until rank 0 measured)
      while (!dropped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    std::thread raise = raise_after_200ms(sub);
    auto t = at::ones({3});
    msg = error_of([&] { all_reduce(sub, t); });
    raise.join();
    const auto t0 = std::chrono::steady_clock::now();
    sub = ProcessGroup();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    dropped = true;
  });
  EXPECT_NE(msg.find("aborted: the test aborts it"), std::string::npos) << msg;
  EXPECT_GE(seconds, 0.0);
  EXPECT_LT(seconds, 5.0) << "dropping an aborted group waited for its abandoned operation";
}

TEST(CommErrors, AnArmedSignalInterruptsASendOrAReceive) {
  // Design note [aborting a group's waits]: Gloo's send and receive works are never seen complete
  // by polling; the raise ends their blocked wait through Work::abort. Rank 1, alive, never posts
  // the matching operation; rank 0's wait must end within about the 200 ms the raise takes.
  for (const bool receive : {true, false}) {
    SCOPED_TRACE(receive ? "recv" : "send");
    std::atomic<bool> done{false};
    double seconds = -1;
    std::string msg, after;
    run_ranks(2, [&](ProcessGroup& pg) {
      ProcessGroup sub = pg.new_group({0, 1});
      if (pg.rank() == 1) {
        while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return;
      }
      std::thread raise = raise_after_200ms(sub);
      auto t = at::ones({1 << 18});
      const auto t0 = std::chrono::steady_clock::now();
      msg = error_of([&] {
        if (receive) {
          recv(sub, t, 1);
        } else {
          send(sub, t, 1);
        }
      });
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      raise.join();
      after = error_of([&] { recv(sub, t, 1); });  // (raised: not started)
      done = true;
    });
    EXPECT_NE(msg.find("aborted: the test aborts it"), std::string::npos) << msg;
    EXPECT_NE(after.find("not started"), std::string::npos) << after;
    EXPECT_GE(seconds, 0.15);
    EXPECT_LT(seconds, 3.0) << "the raise did not end the wait";
  }
}
