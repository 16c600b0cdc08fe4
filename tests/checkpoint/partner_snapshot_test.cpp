// checkpoint::PartnerSnapshots and rebuild_checkpoint (Design note [partner snapshots]): after one
// rank of three is gone, the survivors write from their memory a checkpoint equal, key by key, to
// the synchronous checkpoint of the snapshot's step; the snapshots are copies (the tensors change
// after take()); two lost neighbours are a clear error naming the rank whose state is gone.
#include <gtest/gtest.h>

#include <dirent.h>
#include <sched.h>

#include <cstdlib>
#include <memory>
#include <set>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <ATen/ATen.h>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/partner_snapshot.h"
#include "dtrain/checkpoint/store.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;

namespace {

// What rank `rank` of 3 checkpoints at step 5: a replicated float tensor's third, a bf16 piece of
// odd length (alignment), a per-rank random state and, on rank 2, a 0-dim counter.
std::vector<Piece> snapshot_pieces(int rank, std::vector<at::Tensor>& live) {
  live = {at::arange(1001, at::kFloat) * 0.25f, (at::arange(7, at::kFloat) + 10 * rank).to(at::kBFloat16),
          at::arange(5, at::kLong) + 100 * rank, at::scalar_tensor(int64_t{5}, at::kLong)};
  std::vector<Piece> out{*replicated_piece("model/w", live[0], rank, 3),
                         whole_piece("optim/odd/rank" + std::to_string(rank), live[1]),
                         whole_piece("rng/cpu/rank" + std::to_string(rank), live[2])};
  if (rank == 2) out.push_back(whole_piece("meta/step", live[3]));
  return out;
}

// This process's threads in SCHED_IDLE.
std::set<pid_t> idle_threads() {
  std::set<pid_t> out;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (const dirent* e = ::readdir(dir)) {
      const auto tid = static_cast<pid_t>(std::atoi(e->d_name));
      if (e->d_name[0] != '.' && ::sched_getscheduler(tid) == SCHED_IDLE) out.insert(tid);
    }
    ::closedir(dir);
  }
  return out;
}

}  // namespace

// Design note [background groups yield once ready] (src/checkpoint/background_group.h): the
// snapshots' Gloo threads start at the ordinary priority (a recovery waits on a generation's first
// snapshot) and move to SCHED_IDLE when asked; the ranks' own threads never do.
TEST(PartnerSnapshots, ItsGlooThreadsYieldTheCoresOnlyWhenAsked) {
  const std::set<pid_t> before = idle_threads();  // (an earlier test's, some perhaps ending meanwhile)
  auto new_idle = [&] {
    size_t n = 0;
    for (pid_t t : idle_threads()) n += before.count(t) == 0;
    return n;
  };
  std::vector<std::unique_ptr<PartnerSnapshots>> made(2);
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    made[static_cast<size_t>(pg.rank())] = std::make_unique<PartnerSnapshots>(pg, 1);
  });
  EXPECT_EQ(new_idle(), 0u) << "the threads start at the ordinary priority";
  for (auto& s : made) s->yield_cores();
  EXPECT_GE(new_idle(), 2u) << "each group's Gloo threads yield";
  EXPECT_NE(::sched_getscheduler(0), SCHED_IDLE) << "the caller's own thread keeps its priority";
}

TEST(PartnerSnapshots, SurvivorsRebuildTheCheckpointOfTheStep) {
  const std::string sync_root = dtrain::testing::temp_dir(), rebuilt_root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(3, [&](comm::ProcessGroup& pg) {
    PartnerSnapshots snaps(pg);
    EXPECT_EQ(snaps.partner(), (pg.rank() + 1) % 3);
    EXPECT_EQ(snaps.holding_for(), (pg.rank() + 2) % 3);
    std::vector<at::Tensor> live;
    const auto pieces = snapshot_pieces(pg.rank(), live);
    const std::map<std::string, std::string> md{{"step", "5"}};
    snaps.take(5, pieces, md);
    save(sync_root, 5, pg, pieces, md);
    for (auto& t : live) t.fill_(-7);  // the steps after the snapshot
    EXPECT_EQ(snaps.held().rank, (pg.rank() + 2) % 3);
    if (pg.rank() == 1) return;  // rank 1 is gone
    // The survivors make a group of their own (what the elastic layer will do) and rebuild.
    auto store = c10::make_intrusive<c10d::PrefixStore>("survivors", pg.store());
    comm::ProcessGroup survivors = comm::ProcessGroup::create(comm::BackendKind::Gloo, store, pg.rank() == 0 ? 0 : 1, 2);
    rebuild_checkpoint(rebuilt_root, survivors, snaps, {1});
  }, 60000);
  const Reader want = Reader::open(sync_root), got = Reader::open(rebuilt_root);
  EXPECT_EQ(got.step(), 5);
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& key : want.keys()) EXPECT_TRUE(at::equal(got.read(key), want.read(key))) << key;
  EXPECT_EQ(got.metadata(), want.metadata());
}

TEST(PartnerSnapshots, TwoLostNeighboursAreAClearError) {
  std::string error;
  dtrain::testing::run_ranks(3, [&](comm::ProcessGroup& pg) {
    PartnerSnapshots snaps(pg);
    std::vector<at::Tensor> live;
    snaps.take(5, snapshot_pieces(pg.rank(), live), {});
    if (pg.rank() != 0) return;  // ranks 1 and 2 are gone; rank 2 held rank 1's snapshot
    auto store = c10::make_intrusive<c10d::PrefixStore>("alone", pg.store());
    comm::ProcessGroup alone = comm::ProcessGroup::create(comm::BackendKind::Gloo, store, 0, 1);
    error = dtrain::checkpoint::testing::error_of([&] {
      rebuild_checkpoint(dtrain::testing::temp_dir(), alone, snaps, {1, 2});
    });
  }, 60000);
  EXPECT_NE(error.find("rank 1's snapshot was held by rank 2, which is lost too: rank 1's state of step 5 is gone"),
            std::string::npos) << error;
}

// Design note [partner snapshots]: the host buffers are two pairs, reused: the third snapshot lands
// in the first one's memory, and each complete pair is the newest step's (own and held). Fails if
// take() allocates afresh each time or fills the pair it hands out.
TEST(PartnerSnapshots, DoubleBuffersAreReused) {
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    PartnerSnapshots snaps(pg);
    std::vector<at::Tensor> live;
    std::vector<HeldSnapshot> kept_mine, kept_held;  // (holding them keeps their memory alive)
    std::vector<const void*> mine_at, held_at;
    for (int64_t step = 1; step <= 4; ++step) {
      at::Tensor w = at::full({1000}, static_cast<float>(step * 10 + pg.rank()));
      snaps.take(step, {whole_piece("model/w/rank" + std::to_string(pg.rank()), w)}, {});
      w.fill_(-1);
      kept_mine.push_back(snaps.mine());
      kept_held.push_back(snaps.held());
      mine_at.push_back(snaps.mine().pieces.at(0).data.data_ptr());
      held_at.push_back(snaps.held().pieces.at(0).data.data_ptr());
      EXPECT_EQ(snaps.mine().step, step);
      EXPECT_EQ(snaps.held().step, step);
      EXPECT_TRUE(at::equal(snaps.held().pieces.at(0).data, at::full({1000}, static_cast<float>(step * 10 + 1 - pg.rank()))));
      EXPECT_TRUE(at::equal(snaps.mine().pieces.at(0).data, at::full({1000}, static_cast<float>(step * 10 + pg.rank()))));
    }
    EXPECT_NE(mine_at[0], mine_at[1]);  // the second fills the other pair...
    EXPECT_EQ(mine_at[0], mine_at[2]);  // ...the third the first's memory again
    EXPECT_EQ(mine_at[1], mine_at[3]);
    EXPECT_NE(held_at[0], held_at[1]);
    EXPECT_EQ(held_at[0], held_at[2]);
    // (so what mine() gave at step 1 now holds step 3's values: valid until the second take after)
    EXPECT_TRUE(at::equal(kept_mine[0].pieces.at(0).data, at::full({1000}, static_cast<float>(30 + pg.rank()))));
  }, 60000);
}

// Design note [a copy overlapped with the next step]: with `steady`, take() packs the other pieces
// before it returns (a buffer the next forward changes), the steady ones in the background before
// packed() returns (the parameters, which the optimizer's step changes after that fence), and
// exchanges the pair in the background: after wait(), both copies hold the values at take().
// Fails if packed() does not wait for the packing, or if a piece outside `steady` is deferred.
TEST(PartnerSnapshots, SteadyPiecesArePackedBeforeTheFenceAndExchangedInTheBackground) {
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    PartnerSnapshots snaps(pg);
    const int64_t n = int64_t{1} << 22;  // 16 MiB: a packing that takes a while
    const std::string me = std::to_string(pg.rank()), other = std::to_string(1 - pg.rank());
    at::Tensor w = at::empty({n}), buffer = at::empty({1000});
    for (int64_t step = 1; step <= 3; ++step) {
      w.fill_(static_cast<float>(step * 10 + pg.rank()));
      buffer.fill_(static_cast<float>(step * 100 + pg.rank()));
      snaps.take(step, {whole_piece("model/w/rank" + me, w), whole_piece("model/buffer/rank" + me, buffer)}, {}, {w});
      buffer.fill_(-1);  // the next forward
      EXPECT_GE(snaps.packed(), 0.0);
      w.fill_(-1);  // the next optimizer step
      snaps.wait();
      ASSERT_EQ(snaps.mine().step, step);
      ASSERT_EQ(snaps.held().step, step);
      EXPECT_TRUE(at::equal(snaps.mine().pieces.at(0).data, at::full({n}, static_cast<float>(step * 10 + pg.rank()))));
      EXPECT_TRUE(at::equal(snaps.mine().pieces.at(1).data, at::full({1000}, static_cast<float>(step * 100 + pg.rank()))));
      EXPECT_TRUE(at::equal(snaps.held().pieces.at(0).data, at::full({n}, static_cast<float>(step * 10 + 1 - pg.rank()))));
      EXPECT_TRUE(at::equal(snaps.held().pieces.at(1).data, at::full({1000}, static_cast<float>(step * 100 + 1 - pg.rank()))));
      EXPECT_EQ(snaps.held().pieces.at(0).key, "model/w/rank" + other);
    }
  }, 60000);
}
