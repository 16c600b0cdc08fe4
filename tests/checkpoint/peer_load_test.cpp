// checkpoint::load_from_peers (Design note [state re-split from memory]): state held in the ranks'
// memory, split for one world size, loads at another through any loader that reads a Reader: every
// range arrives with its values whichever rank held it (W = 1, 2, 3; uneven splits; a rank holding
// nothing; a lost rank's pieces held by its partner), each element from the lowest holding rank,
// and the bad cases are errors on every rank (no rank left waiting) naming the cause.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "dtrain/checkpoint/peer_load.h"
#include "dtrain/comm/split.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;

namespace {

// The whole state: a float vector of 1001 elements, a bf16 vector of 7, a 0-dim counter.
at::Tensor w_full() { return at::arange(1001, at::kFloat) * 0.25f; }
at::Tensor b_full() { return (at::arange(7, at::kFloat) + 3).to(at::kBFloat16); }

// Old rank `r` of `world`'s pieces (replicated tensors split evenly; the counter on the last rank).
std::vector<Piece> old_pieces(int r, int world) {
  std::vector<Piece> out;
  if (auto p = replicated_piece("model/w", w_full(), r, world)) out.push_back(*p);
  if (auto p = replicated_piece("optim/b", b_full(), r, world)) out.push_back(*p);
  if (r == world - 1) out.push_back(whole_piece("meta/count", at::scalar_tensor(int64_t{42}, at::kLong)));
  return out;
}

// What a loader at `rank` of `world` does: its even split of w, all of b and the counter.
struct Loaded {
  at::Tensor w, b, count;
  int64_t begin = 0;
};
Loaded load_part(const Reader& r, int rank, int world) {
  const auto counts = comm::even_split(r.info("model/w").numel(), world);
  const int64_t begin = comm::offsets_of(counts)[rank];
  Loaded l;
  l.begin = begin;
  l.w = r.read("model/w", begin, begin + counts[rank]);
  l.b = r.read("optim/b");
  l.count = at::empty({}, at::kLong);
  r.read_into("meta/count", l.count);
  return l;
}

void expect_part(const Loaded& l, int rank, int world) {
  const auto counts = comm::even_split(1001, world);
  EXPECT_TRUE(at::equal(l.w, w_full().narrow(0, comm::offsets_of(counts)[rank], counts[rank]))) << "rank " << rank;
  EXPECT_TRUE(at::equal(l.b, b_full())) << "rank " << rank;
  EXPECT_EQ(l.count.item<int64_t>(), 42);
}

}  // namespace

TEST(PeerLoad, TwoRanksHoldThreeLoad) {
  // Grown: the old world of 2 holds it all, the third rank (joining) nothing.
  dtrain::testing::run_ranks(3, [&](comm::ProcessGroup& pg) {
    HeldState held;
    if (pg.rank() < 2) held = {7, 2, {{"k", "v"}}, old_pieces(pg.rank(), 2)};
    Loaded l;
    int calls = 0;
    const PeerLoadStats stats = load_from_peers(pg, held, [&](const Reader& r) {
      ++calls;
      EXPECT_EQ(r.step(), 7);
      EXPECT_EQ(r.saved_world_size(), 2);
      EXPECT_EQ(r.metadata().at("k"), "v");
      l = load_part(r, pg.rank(), 3);
    });
    EXPECT_EQ(calls, 2);  // (the recording run, then the loading one)
    expect_part(l, pg.rank(), 3);
    if (pg.rank() == 2) EXPECT_EQ(stats.bytes_sent, 0);
    if (pg.rank() == 2) EXPECT_EQ(stats.bytes_received, 333 * 4 + 7 * 2 + 8);  // (its third of w, b, the counter: all from the others)
  }, 60000);
}

TEST(PeerLoad, ALostRanksPiecesFromItsPartnerThreeToTwo) {
  // Shrunk: old ranks 0, 1, 2; rank 1 is lost and its pieces are held by its partner, old rank 2
  // (new rank 1), beside its own.
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    HeldState held{3, 3, {}, old_pieces(pg.rank() == 0 ? 0 : 2, 3)};
    if (pg.rank() == 1) {
      for (const Piece& p : old_pieces(1, 3)) held.pieces.push_back(p);
    }
    Loaded l;
    load_from_peers(pg, held, [&](const Reader& r) { l = load_part(r, pg.rank(), 2); });
    expect_part(l, pg.rank(), 2);
  }, 60000);
}

TEST(PeerLoad, OneRankAndTheLowestHolderWins) {
  dtrain::testing::run_ranks(1, [&](comm::ProcessGroup& pg) {
    Loaded l;
    load_from_peers(pg, {1, 1, {}, old_pieces(0, 1)}, [&](const Reader& r) { l = load_part(r, 0, 1); });
    expect_part(l, 0, 1);
  }, 60000);
  // Both hold all of it, rank 1's w differs: every rank reads rank 0's.
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    std::vector<Piece> pieces = old_pieces(0, 1);
    if (pg.rank() == 1) pieces[0].data = pieces[0].data + 1;
    Loaded l;
    load_from_peers(pg, {1, 1, {}, pieces}, [&](const Reader& r) { l = load_part(r, pg.rank(), 2); });
    expect_part(l, pg.rank(), 2);
  }, 60000);
}

TEST(PeerLoad, BadCasesFailOnEveryRankWithTheCause) {
  auto expect_error = [](int world, const std::function<HeldState(int)>& held_of,
                         const std::function<void(const Reader&, int)>& load, const std::string& cause) {
    dtrain::testing::run_ranks(world, [&](comm::ProcessGroup& pg) {
      try {
        load_from_peers(pg, held_of(pg.rank()), [&](const Reader& r) { load(r, pg.rank()); });
        ADD_FAILURE() << "rank " << pg.rank() << ": no error (expected: " << cause << ")";
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find(cause), std::string::npos) << "rank " << pg.rank() << ": " << e.what();
      }
    }, 60000);
  };
  const auto read_all = [](const Reader& r, int rank) { load_part(r, rank, 2); };
  // Old rank 1 of 3 lost with nobody holding its pieces: its third of w is nowhere.
  expect_error(2, [](int r) { return HeldState{3, 3, {}, old_pieces(r == 0 ? 0 : 2, 3)}; }, read_all,
               "of \"model/w\" are held by no rank");
  // One rank's loader fails: every rank stops, naming it.
  expect_error(2, [](int r) { return HeldState{1, 1, {}, old_pieces(0, 1)}; },
               [](const Reader& r, int rank) {
                 if (rank == 1) throw std::runtime_error("no such parameter here");
                 load_part(r, rank, 2);
               },
               "rank 1 could not load: no such parameter here");
  // Pieces of two steps.
  expect_error(2, [](int r) { return HeldState{r == 0 ? 4 : 5, 2, {}, old_pieces(r, 2)}; }, read_all,
               "rank 1 holds state of step 5, rank 0 of step 4");
}
