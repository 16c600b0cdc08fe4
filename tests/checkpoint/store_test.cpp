// save()/Reader across ranks: round trips at W = 1, 2, 3, resharding, errors agreed by every rank,
// keep_last, latest.
#include <gtest/gtest.h>

#include <mutex>

#include <ATen/ATen.h>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/comm/split.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;
namespace fs = dtrain::util::fs;

namespace {

// The same "training state" on every rank (seeded), with tensors of every supported dtype.
std::map<std::string, at::Tensor> full_state() {
  at::manual_seed(7);
  std::map<std::string, at::Tensor> s;
  s["model/w"] = at::randn({5, 7});
  s["model/b"] = at::randn({7}, at::kDouble);
  s["model/h"] = at::randn({6}).to(at::kBFloat16);
  s["model/f16"] = at::randn({3, 3}).to(at::kHalf);
  s["model/ids"] = at::randint(-1000, 1000, {3, 4}, at::kLong);
  s["model/i32"] = at::randint(-1000, 1000, {9}, at::kInt);
  s["model/i16"] = at::randint(-1000, 1000, {2}, at::kShort);
  s["model/i8"] = at::randint(-100, 100, {4}, at::kChar);
  s["model/u8"] = at::randint(0, 255, {13}, at::kByte);
  s["model/mask"] = at::randn({10}) > 0;
  s["model/scalar"] = at::scalar_tensor(3.5);
  s["model/empty"] = at::empty({0, 3});
  s["optim/step"] = at::scalar_tensor(42, at::kLong);
  return s;
}

// Rank r's pieces: replicated tensors split among ranks, "model/ids" whole from the last rank,
// and one rank-local tensor per rank.
std::vector<Piece> pieces_of(const std::map<std::string, at::Tensor>& state, int rank, int world) {
  std::vector<Piece> pieces;
  for (const auto& [key, t] : state) {
    if (key == "model/ids") {
      if (rank == world - 1) pieces.push_back(whole_piece(key, t));
      continue;
    }
    if (auto p = replicated_piece(key, t, rank, world)) pieces.push_back(*p);
  }
  pieces.push_back(whole_piece("rng/rank" + std::to_string(rank), at::full({5}, rank, at::kByte)));
  return pieces;
}

void expect_equal(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  EXPECT_EQ(a.sizes(), b.sizes()) << what;
  EXPECT_EQ(a.scalar_type(), b.scalar_type()) << what;
  if (a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type()) EXPECT_TRUE(at::equal(a, b)) << what;
}

class SaveAndRead : public ::testing::TestWithParam<int> {};

}  // namespace

TEST(ReplicatedPiece, SplitsEvenlyAndKeepsEmptyTensors) {
  const auto t = at::arange(10, at::kFloat).reshape({2, 5});
  std::vector<int64_t> begins, sizes;
  for (int r = 0; r < 3; ++r) {
    auto p = replicated_piece("k", t, r, 3);
    ASSERT_TRUE(p);
    EXPECT_EQ(p->shape, (std::vector<int64_t>{2, 5}));
    begins.push_back(p->begin);
    sizes.push_back(p->data.numel());
    EXPECT_TRUE(at::equal(p->data, t.reshape({-1}).narrow(0, p->begin, p->data.numel())));
  }
  EXPECT_EQ(begins, (std::vector<int64_t>{0, 4, 7}));
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 3, 3}));
  EXPECT_FALSE(replicated_piece("k", at::ones({2}), 2, 3));       // nothing left for rank 2
  EXPECT_TRUE(replicated_piece("k", at::empty({0}), 0, 3));       // rank 0 records an empty tensor
  EXPECT_FALSE(replicated_piece("k", at::empty({0}), 1, 3));
  auto scalar = replicated_piece("s", at::scalar_tensor(1.0), 0, 2);
  ASSERT_TRUE(scalar);
  EXPECT_EQ(scalar->shape, std::vector<int64_t>{});
  EXPECT_THROW(replicated_piece("k", t, 3, 3), c10::Error);
}

TEST_P(SaveAndRead, EveryKeyAndRangeRoundTrips) {
  const int world = GetParam();
  const std::string root = dtrain::testing::temp_dir() + "/ckpt";
  const auto state = full_state();
  std::mutex mu;
  std::vector<std::string> dirs(world);
  dtrain::testing::run_ranks(world, [&](comm::ProcessGroup& pg) {
    const std::string dir = save(root, 12, pg, pieces_of(state, pg.rank(), world), {{"strategy", "ddp"}, {"epoch", "3"}});
    std::lock_guard<std::mutex> lock(mu);
    dirs[pg.rank()] = dir;
  });
  for (const auto& d : dirs) EXPECT_EQ(d, root + "/step-00000012");
  EXPECT_EQ(latest(root), root + "/step-00000012");
  for (int r = 0; r < world; ++r) EXPECT_TRUE(fs::exists(root + "/step-00000012/rank-0000" + std::to_string(r) + ".safetensors"));
  EXPECT_TRUE(fs::exists(root + "/step-00000012/manifest.json"));

  const Reader reader = Reader::open(root);
  EXPECT_EQ(reader.dir(), root + "/step-00000012");
  EXPECT_EQ(reader.step(), 12);
  EXPECT_EQ(reader.saved_world_size(), world);
  EXPECT_EQ(reader.metadata().at("strategy"), "ddp");
  EXPECT_EQ(reader.metadata().at("epoch"), "3");
  std::vector<std::string> expected_keys;
  for (const auto& kv : state) expected_keys.push_back(kv.first);
  for (int r = 0; r < world; ++r) expected_keys.push_back("rng/rank" + std::to_string(r));
  std::sort(expected_keys.begin(), expected_keys.end());
  EXPECT_EQ(reader.keys(), expected_keys);
  EXPECT_EQ(reader.keys_with_prefix("optim/"), std::vector<std::string>{"optim/step"});
  EXPECT_EQ(reader.keys_with_prefix("rng/").size(), static_cast<size_t>(world));
  EXPECT_TRUE(reader.keys_with_prefix("zzz").empty());
  for (const auto& [key, t] : state) {
    EXPECT_TRUE(reader.has(key));
    const TensorInfo info = reader.info(key);
    EXPECT_EQ(info.shape, t.sizes().vec()) << key;
    EXPECT_EQ(info.dtype, t.scalar_type()) << key;
    expect_equal(reader.read(key), t, key);
    // Every range [b, e) of the flat tensor.
    const auto flat = t.reshape({-1});
    for (int64_t b = 0; b <= flat.numel(); ++b) {
      for (int64_t e = b; e <= flat.numel(); e += 3) expect_equal(reader.read(key, b, e), flat.narrow(0, b, e - b), key);
    }
    at::Tensor out = at::zeros_like(t);
    reader.read_into(key, out);
    expect_equal(out, t, key);
  }
  for (int r = 0; r < world; ++r) expect_equal(reader.read("rng/rank" + std::to_string(r)), at::full({5}, r, at::kByte), "rng");
  EXPECT_FALSE(reader.has("model/nope"));
  EXPECT_ERROR_WITH(reader.info("model/nope"), "no tensor \"model/nope\" in this checkpoint");
  EXPECT_ERROR_WITH(reader.read("model/w", 30, 36), "read of \"model/w\" elements [30, 36) outside its 35 elements");
  EXPECT_ERROR_WITH(reader.read("model/w", -1, 3), "outside");
  at::Tensor wrong = at::zeros({7, 5});
  EXPECT_ERROR_WITH(reader.read_into("model/w", wrong), "read_into(\"model/w\"): the checkpoint holds shape [5, 7] Float");
  at::Tensor wrong_dtype = at::zeros({5, 7}, at::kDouble);
  EXPECT_ERROR_WITH(reader.read_into("model/w", wrong_dtype), "output tensor is [5, 7] Double");
  // read_into a non-contiguous tensor and a parameter that requires grad.
  at::Tensor nc = at::zeros({7, 5}).t();
  reader.read_into("model/w", nc);
  expect_equal(nc, state.at("model/w"), "non-contiguous");
  at::Tensor param = at::zeros({5, 7}).requires_grad_();
  reader.read_into("model/w", param);
  EXPECT_TRUE(at::equal(param.detach(), state.at("model/w")));
  // The directory itself opens too.
  EXPECT_EQ(Reader::open(root + "/step-00000012").step(), 12);
}

INSTANTIATE_TEST_SUITE_P(World, SaveAndRead, ::testing::Values(1, 2, 3));

TEST(Reshard, FlatShardsOfThreeRanksReadBackAsTwoOrFourRanges) {
  // FSDP-like: the tensors are concatenated into one flat buffer split evenly over 3 ranks; each
  // rank saves the parts of the tensors its shard covers (ranges cross tensor boundaries).
  at::manual_seed(3);
  const std::vector<std::pair<std::string, at::Tensor>> params = {
      {"model/a", at::randn({4, 5})}, {"model/b", at::randn({3})}, {"model/c", at::randn({2, 2, 3})}, {"model/d", at::randn({1})}};
  int64_t total = 0;
  for (const auto& p : params) total += p.second.numel();
  const std::string root = dtrain::testing::temp_dir();
  dtrain::testing::run_ranks(3, [&](comm::ProcessGroup& pg) {
    const auto counts = comm::even_split(total, 3);
    const auto offsets = comm::offsets_of(counts);
    const int64_t lo = offsets[pg.rank()], hi = offsets[pg.rank() + 1];
    std::vector<Piece> pieces;
    int64_t at = 0;
    for (const auto& [key, t] : params) {
      const int64_t b = std::max(lo, at), e = std::min(hi, at + t.numel());
      if (b < e) pieces.push_back({key, t.sizes().vec(), b - at, t.reshape({-1}).slice(0, b - at, e - at)});
      at += t.numel();
    }
    save(root, 5, pg, pieces, {});
  });
  const Reader reader = Reader::open(root);
  EXPECT_EQ(reader.saved_world_size(), 3);
  for (int parts : {1, 2, 4}) {
    for (const auto& [key, t] : params) {
      const auto counts = comm::even_split(t.numel(), parts);
      const auto offsets = comm::offsets_of(counts);
      std::vector<at::Tensor> chunks;
      for (int r = 0; r < parts; ++r) chunks.push_back(reader.read(key, offsets[r], offsets[r + 1]));
      EXPECT_TRUE(at::equal(at::cat(chunks).reshape(t.sizes()), t)) << key << " in " << parts << " parts";
    }
  }
  // And each rank of a 2-rank group reads its own range (what a resumed run at W=2 does).
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    const Reader r = Reader::open(root);
    for (const auto& [key, t] : params) {
      const auto offsets = comm::offsets_of(comm::even_split(t.numel(), 2));
      const auto mine = r.read(key, offsets[pg.rank()], offsets[pg.rank() + 1]);
      TORCH_CHECK(at::equal(mine, t.reshape({-1}).slice(0, offsets[pg.rank()], offsets[pg.rank() + 1])), key);
    }
  });
}

namespace {

// Runs save on `world` ranks with pieces from `make`; returns each rank's error ("" = success).
std::vector<std::string> save_errors(int world, const std::string& root, int64_t step,
                                     const std::function<std::vector<Piece>(int)>& make,
                                     const std::function<std::map<std::string, std::string>(int)>& meta = {}) {
  std::vector<std::string> errors(world);
  std::mutex mu;
  dtrain::testing::run_ranks(world, [&](comm::ProcessGroup& pg) {
    const std::string e = dtrain::checkpoint::testing::error_of([&] {
      save(root, step, pg, make(pg.rank()), meta ? meta(pg.rank()) : std::map<std::string, std::string>{});
    });
    std::lock_guard<std::mutex> lock(mu);
    errors[pg.rank()] = e;
  });
  return errors;
}

void expect_all(const std::vector<std::string>& errors, const std::string& needle) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << " expected: " << needle << "\n got: " << errors[r];
  }
}

}  // namespace

TEST(SaveErrors, ReportedOnEveryRankAndNothingIsCommitted) {
  const std::string root = dtrain::testing::temp_dir();
  const auto w = at::arange(12, at::kFloat);
  // A good checkpoint first: failed saves must leave it as latest.
  auto ok = save_errors(2, root, 1, [&](int r) { return std::vector<Piece>{*replicated_piece("w", w, r, 2)}; });
  ASSERT_EQ(ok, (std::vector<std::string>{"", ""}));

  // Both ranks save the whole tensor: overlap.
  expect_all(save_errors(2, root, 2, [&](int) { return std::vector<Piece>{whole_piece("w", w)}; }),
             "key \"w\": elements [0, 12) saved by rank 1 overlap [0, 12) saved by rank 0");
  // Rank 1 saves nothing: a gap.
  expect_all(save_errors(2, root, 2, [&](int r) {
               return r == 0 ? std::vector<Piece>{*replicated_piece("w", w, 0, 2)} : std::vector<Piece>{};
             }),
             "key \"w\": elements [6, 12) of 12 are saved by no rank");
  // A missing range in the middle.
  expect_all(save_errors(3, root, 2, [&](int r) {
               return r == 1 ? std::vector<Piece>{} : std::vector<Piece>{*replicated_piece("w", w, r, 3)};
             }),
             "key \"w\": elements [4, 8) of 12 are saved by no rank (rank 0 ends at 4, rank 2 starts at 8)");
  // Shapes or dtypes that differ between ranks.
  expect_all(save_errors(2, root, 2, [&](int r) {
               auto p = *replicated_piece("w", w, r, 2);
               if (r == 1) p.shape = {3, 4};
               return std::vector<Piece>{p};
             }),
             "key \"w\": rank 0 saved shape [12] F32, rank 1 saved shape [3, 4] F32");
  expect_all(save_errors(2, root, 2, [&](int r) {
               return std::vector<Piece>{*replicated_piece("w", r == 1 ? w.to(at::kDouble) : w, r, 2)};
             }),
             "rank 1 saved shape [12] F64");
  // One rank's bad piece: every rank hears about it, naming the rank.
  expect_all(save_errors(3, root, 2, [&](int r) {
               auto p = *replicated_piece("w", w, r, 3);
               if (r == 2) p.begin = 10;
               return std::vector<Piece>{p};
             }),
             "rank 2: piece of key \"w\" at element 10: elements [10, 14) lie outside the tensor's 12 elements");
  expect_all(save_errors(2, root, 2, [&](int r) { return std::vector<Piece>{whole_piece("c", at::ones({2}, at::kComplexFloat))}; }),
             "cannot be stored in safetensors");
  expect_all(save_errors(2, root, 2, [&](int r) { return std::vector<Piece>{*replicated_piece("w", w, r, 2)}; },
                         [](int r) { return std::map<std::string, std::string>{{"epoch", r == 1 ? "4" : "3"}}; }),
             "rank 1's metadata differs from rank 0's (at key \"epoch\")");
  expect_all(save_errors(2, root, 2, [&](int r) {
               return std::vector<Piece>{*replicated_piece("w", w, r, 2), *replicated_piece("w", w, r, 2)};
             }),
             "has two pieces named");

  // None of that committed anything or left a temporary directory behind.
  EXPECT_EQ(latest(root), root + "/step-00000001");
  std::vector<std::string> names = fs::list_directory(root);
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000001"}));
  EXPECT_TRUE(at::equal(Reader::open(root).read("w"), w));
}

TEST(Save, KeepLastDeletesOlderCheckpointsAndResavingAStepReplacesIt) {
  const std::string root = dtrain::testing::temp_dir();
  auto save_step = [&](int64_t step, float value, SaveOptions options) {
    dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
      save(root, step, pg, {*replicated_piece("w", at::full({4}, value), pg.rank(), 2)}, {}, options);
    });
  };
  for (int s = 1; s <= 5; ++s) save_step(s, s, SaveOptions());
  auto dirs = [&] {
    return fs::list_directory(root);
  };
  EXPECT_EQ(dirs(), (std::vector<std::string>{"latest", "step-00000004", "step-00000005"}));
  save_step(6, 6, SaveOptions().keep_last(0).fsync(false));
  save_step(7, 7, SaveOptions().keep_last(0));
  EXPECT_EQ(dirs(), (std::vector<std::string>{"latest", "step-00000004", "step-00000005", "step-00000006", "step-00000007"}));
  // Resuming from step 5 and saving step 6 again replaces the old step 6 and leaves 7 (a later
  // step, of the abandoned run) alone until it is saved again.
  save_step(6, 60, SaveOptions().keep_last(2));
  EXPECT_EQ(dirs(), (std::vector<std::string>{"latest", "step-00000005", "step-00000006", "step-00000007"}));
  EXPECT_EQ(*latest(root), root + "/step-00000006");
  EXPECT_TRUE(at::equal(Reader::open(root).read("w"), at::full({4}, 60.0f)));
  // Re-saving the step that latest names swaps it in place.
  save_step(6, 61, SaveOptions());
  EXPECT_TRUE(at::equal(Reader::open(root).read("w"), at::full({4}, 61.0f)));
  // keep_last(1): only the new one.
  save_step(7, 70, SaveOptions().keep_last(1));
  EXPECT_EQ(dirs(), (std::vector<std::string>{"latest", "step-00000007"}));
  EXPECT_TRUE(at::equal(Reader::open(root).read("w"), at::full({4}, 70.0f)));
}

TEST(Latest, NoneYetMissingDirectoryAndGarbage) {
  const std::string root = dtrain::testing::temp_dir();
  EXPECT_EQ(latest(root), std::nullopt);
  EXPECT_EQ(latest(root + "/does-not-exist"), std::nullopt);
  EXPECT_ERROR_WITH(Reader::open(root), "neither a checkpoint directory (no manifest.json) nor a checkpoint root (no latest)");
  dtrain::checkpoint::testing::write_bytes(root + "/latest", "step-00000009\n");
  EXPECT_ERROR_WITH(latest(root), "names step-00000009, but " + root + "/step-00000009 does not exist");
  EXPECT_ERROR_WITH(Reader::open(root), "does not exist");
  dtrain::checkpoint::testing::write_bytes(root + "/latest", "../../etc");
  EXPECT_ERROR_WITH(latest(root), "does not hold a checkpoint directory name like step-00000012 (9 bytes of something else)");
  EXPECT_EQ(step_dir_name(12), "step-00000012");
  EXPECT_EQ(step_dir_name(123456789012), "step-123456789012");
}
