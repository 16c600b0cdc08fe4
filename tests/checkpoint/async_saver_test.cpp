// checkpoint::AsyncSaver (Design note [asynchronous saves]): what a background save writes is the
// state at the save, whatever the steps after it do; its files are a synchronous save's; a failure
// in the background is rethrown naming the rank, the step and the path, with `latest` left on the
// last complete checkpoint; one save in flight at a time, buffers reused. Crashes during background
// writes are in crash_test.cpp; --save-async in the training loop in
// tests/examples/async_checkpoint_test.cpp.
#include <gtest/gtest.h>

#include <fstream>

#include <ATen/ATen.h>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/async_saver.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/comm/barrier.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;
using dtrain::checkpoint::testing::error_of;
using dtrain::checkpoint::testing::read_bytes;

namespace {

constexpr int64_t kSaverNumel = 1 << 22;  // 16 MiB of float per save: a write that takes a while

at::Tensor saver_values(int64_t step) { return at::arange(kSaverNumel, at::kFloat) * 0.5f + static_cast<float>(step); }

std::vector<Piece> saver_pieces(const at::Tensor& w, const at::Tensor& counter, const comm::ProcessGroup& pg) {
  std::vector<Piece> out{*replicated_piece("model/w", w, pg.rank(), pg.size())};
  if (pg.rank() == 0) out.push_back(whole_piece("meta/counter", counter));
  return out;
}

}  // namespace

// The tensors change right after save() returns (as the next training step would change them):
// the checkpoint still holds their values at the save. Fails if the saver wrote the live tensors.
TEST(AsyncSaver, WritesTheStateAtTheSaveNotTheStepsAfter) {
  const std::string root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    AsyncSaver saver(pg);
    at::Tensor w = saver_values(1), counter = at::scalar_tensor(int64_t{1}, at::kLong);
    for (int64_t step = 1; step <= 3; ++step) {
      w.copy_(saver_values(step));
      counter.fill_(step);
      saver.save(root, step, saver_pieces(w, counter, pg), {{"step", std::to_string(step)}});
      w.fill_(-1.0f);  // the "next step"
      counter.fill_(-1);
    }
    saver.wait();
  }, 60000);
  for (int64_t step : {2, 3}) {
    const Reader r = Reader::open(root + "/" + step_dir_name(step));
    EXPECT_TRUE(at::equal(r.read("model/w"), saver_values(step))) << "step " << step;
    EXPECT_EQ(r.read("meta/counter").item<int64_t>(), step);
  }
  EXPECT_EQ(Reader::open(root).step(), 3);
}

// Design note [a copy overlapped with the next step]: a save given the steady tensors copies the
// other pieces before it returns (a buffer a forward changes at once), the steady ones in the
// background before copied() returns (the parameters, which the optimizer's step changes after the
// fence). Fails if copied() does not wait for the copy, or if a piece outside `steady` is deferred.
TEST(AsyncSaver, SteadyPiecesAreCopiedBeforeTheFenceTheRestBeforeSaveReturns) {
  const std::string root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    AsyncSaver saver(pg);
    EXPECT_EQ(saver.copied(), 0.0);  // nothing pending
    at::Tensor w = saver_values(1), buffer = saver_values(1), counter = at::scalar_tensor(int64_t{1}, at::kLong);
    for (int64_t step = 1; step <= 3; ++step) {
      w.copy_(saver_values(step));
      buffer.copy_(saver_values(step) * 2);
      counter.fill_(step);
      std::vector<Piece> pieces = saver_pieces(w, counter, pg);
      pieces.push_back(*replicated_piece("model/buffer", buffer, pg.rank(), pg.size()));
      const AsyncSaveStats stats = saver.save(root, step, pieces, {}, {w});
      EXPECT_EQ(stats.overlapped_bytes, static_cast<int64_t>((kSaverNumel / 2) * 4));  // w's piece only
      buffer.fill_(-1.0f);  // the next forward
      counter.fill_(-1);
      EXPECT_GE(saver.copied(), 0.0);
      w.fill_(-1.0f);  // the next optimizer step
    }
    saver.wait();
    const auto last = saver.finished();
    ASSERT_TRUE(last);
    EXPECT_GT(last->copy_s, 0.0);
  }, 60000);
  for (int64_t step : {2, 3}) {
    const Reader r = Reader::open(root + "/" + step_dir_name(step));
    EXPECT_TRUE(at::equal(r.read("model/w"), saver_values(step))) << "step " << step;
    EXPECT_TRUE(at::equal(r.read("model/buffer"), saver_values(step) * 2)) << "step " << step;
    EXPECT_EQ(r.read("meta/counter").item<int64_t>(), step);
  }
}

// The same pieces saved synchronously and asynchronously give byte-identical rank files.
TEST(AsyncSaver, FilesEqualASynchronousSave) {
  const std::string sync_root = dtrain::testing::temp_dir(), async_root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    const at::Tensor w = saver_values(7), counter = at::scalar_tensor(int64_t{7}, at::kLong);
    save(sync_root, 7, pg, saver_pieces(w, counter, pg), {{"step", "7"}});
    AsyncSaver saver(pg);
    saver.save(async_root, 7, saver_pieces(w, counter, pg), {{"step", "7"}});
    saver.wait();
  }, 60000);
  for (const char* file : {"rank-00000.safetensors", "rank-00001.safetensors", "manifest.json"}) {
    const std::string a = read_bytes(async_root + "/step-00000007/" + file);
    EXPECT_FALSE(a.empty()) << file;
    EXPECT_EQ(a, read_bytes(sync_root + "/step-00000007/" + file)) << file;
  }
}

// One save in flight: the second waits for the first; finished() reports each once; the host
// buffers are allocated once and reused.
TEST(AsyncSaver, OneSaveInFlightAndBuffersReused) {
  const std::string root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    AsyncSaver saver(pg);
    const at::Tensor w = saver_values(1), counter = at::scalar_tensor(int64_t{1}, at::kLong);
    const AsyncSaveStats first = saver.save(root, 1, saver_pieces(w, counter, pg), {});
    EXPECT_EQ(first.bytes, static_cast<int64_t>((kSaverNumel / 2) * 4 + (pg.rank() == 0 ? 8 : 0)));
    EXPECT_EQ(first.waited_s, 0.0);
    const int64_t held = saver.buffer_bytes();
    EXPECT_EQ(held, first.bytes);
    const AsyncSaveStats second = saver.save(root, 2, saver_pieces(w, counter, pg), {});
    EXPECT_LE(second.waited_s, second.stall_s);
    EXPECT_EQ(saver.buffer_bytes(), held);  // reused, not reallocated
    const auto done = saver.finished();     // the first (the second save waited for it)
    ASSERT_TRUE(done);
    EXPECT_EQ(done->step, 1);
    EXPECT_GT(done->write_s, 0.0);
    EXPECT_GT(done->write_cpu_s, 0.0);  // (the thread hashed and wrote: it took CPU time)
    EXPECT_LE(done->write_cpu_s, done->write_s + 0.05);
    EXPECT_FALSE(saver.finished());
    saver.wait();
    EXPECT_FALSE(saver.in_flight());
    ASSERT_TRUE(saver.finished());
    EXPECT_FALSE(saver.finished());
  }, 60000);
  EXPECT_EQ(Reader::open(root).step(), 2);
}

// reserve() makes the buffers in the background (from the pieces' shapes, not their data): the
// first save then allocates nothing, and still writes the values at the save. Fails if reserve()
// does nothing or its buffers are not the ones save() uses.
TEST(AsyncSaver, ReservedBuffersAreTheOnesTheFirstSaveUses) {
  const std::string root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    AsyncSaver saver(pg);
    at::Tensor w = saver_values(1), counter = at::scalar_tensor(int64_t{1}, at::kLong);
    saver.reserve(saver_pieces(w, counter, pg));
    saver.wait();
    const int64_t reserved = saver.buffer_bytes();
    EXPECT_EQ(reserved, static_cast<int64_t>((kSaverNumel / 2) * 4 + (pg.rank() == 0 ? 8 : 0)));
    w.copy_(saver_values(4));
    counter.fill_(4);
    const AsyncSaveStats first = saver.save(root, 4, saver_pieces(w, counter, pg), {});
    EXPECT_EQ(saver.buffer_bytes(), reserved);
    EXPECT_EQ(first.waited_s, 0.0);
    saver.reserve(saver_pieces(w, counter, pg));  // all there: nothing to do, no wait for the write
    EXPECT_TRUE(saver.in_flight() || saver.finished());
    saver.wait();
  }, 60000);
  const Reader r = Reader::open(root);
  EXPECT_TRUE(at::equal(r.read("model/w"), saver_values(4)));
  EXPECT_EQ(r.read("meta/counter").item<int64_t>(), 4);
}

// A background save that cannot commit (a file stands where its directory must go): wait() rethrows
// it naming the rank, the step and the path; `latest` still names the last complete checkpoint, no
// temporary directory is left, and the saver saves again afterwards.
TEST(AsyncSaver, BackgroundFailureIsReportedAndLatestStays) {
  const std::string root = dtrain::testing::temp_dir();
  { std::ofstream(root + "/" + step_dir_name(2)) << "not a directory"; }
  std::vector<std::string> errors(2);
  std::vector<int64_t> latest_after(2, -1);
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    AsyncSaver saver(pg);
    const at::Tensor w = saver_values(1), counter = at::scalar_tensor(int64_t{1}, at::kLong);
    saver.save(root, 1, saver_pieces(w, counter, pg), {});
    saver.save(root, 2, saver_pieces(w, counter, pg), {});
    errors[static_cast<size_t>(pg.rank())] = error_of([&] { saver.wait(); });
    saver.check();  // (reported once)
    latest_after[static_cast<size_t>(pg.rank())] = Reader::open(root).step();
    saver.save(root, 3, saver_pieces(w, counter, pg), {});
    saver.wait();
  }, 60000);
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& e = errors[static_cast<size_t>(rank)];
    EXPECT_NE(e.find("rank " + std::to_string(rank) + ": the asynchronous checkpoint of step 2 failed in the "
                     "background"), std::string::npos) << e;
    EXPECT_NE(e.find("checkpoint save of step 2 to " + root), std::string::npos) << e;
    EXPECT_EQ(latest_after[static_cast<size_t>(rank)], 1);
  }
  EXPECT_EQ(Reader::open(root).step(), 3);
  for (const auto& name : dtrain::util::fs::list_directory(root)) {
    EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
  }
}

// Design note [a cached save plan] (store.cpp): from the second save on, a save runs no collective
// before its files are written: two fewer all-gathers per rank than the first (the phase that
// checked the pieces and named the temporary directory), and the checkpoints are as complete.
TEST(AsyncSaver, LaterSavesRunOnlyTheCommitsAgreement) {
  const std::string root = dtrain::testing::temp_dir();
  std::vector<int64_t> deltas;
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    AsyncSaver saver(pg);
    const at::Tensor w = saver_values(1), counter = at::scalar_tensor(int64_t{1}, at::kLong);
    for (int64_t step = 1; step <= 3; ++step) {
      // (barriers around the count: no rank has begun the save when it is read, every rank has
      // ended it when it is read again)
      comm::barrier(pg);
      const int64_t before = comm::traffic().calls;
      comm::barrier(pg);
      saver.save(root, step, saver_pieces(w, counter, pg), {});
      saver.wait();
      comm::barrier(pg);
      if (pg.rank() == 0) deltas.push_back(comm::traffic().calls - before);
    }
  }, 60000);
  ASSERT_EQ(deltas.size(), 3u);
  EXPECT_EQ(deltas[0] - deltas[1], 2 * 2) << deltas[0] << " then " << deltas[1];  // 2 ranks x 2 all-gathers
  EXPECT_EQ(deltas[1], deltas[2]);
  for (int64_t step : {2, 3}) EXPECT_EQ(Reader::open(root + "/" + step_dir_name(step)).step(), step);  // (keep_last 2)
}
