// FSDP state dicts: the full state dict has the unwrapped module's keys and loads into a plain
// libtorch module; load_full_state_dict round trip; sharded state dicts saved at one world size load
// at another; and the large-model path (GPT built with defer_init, initialised on the ranks).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp_testing.h"

using namespace dtrain;
using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;
using fsdp::ShardingStrategy;

namespace {

fsdp::FullyShardedOptions toy_options(ShardingStrategy st = ShardingStrategy::FullShard, fsdp::MeshLayout hybrid = {0, 0}) {
  return fsdp::FullyShardedOptions().sharding(st).hybrid_layout(hybrid).wrap_policy(
      fsdp::WrapPolicy::by_type<HookLinearImpl>());
}

// Copies every entry of `dict` into the plain module's parameter or buffer of that name; every
// parameter and buffer of the module must be there, with its shape.
void load_into_plain(torch::nn::Module& m, const Dict& dict) {
  torch::NoGradGuard no_grad;
  size_t n = 0;
  auto load = [&](const std::string& key, at::Tensor& t) {
    const at::Tensor* v = dict.find(key);
    ASSERT_NE(v, nullptr) << "full state dict lacks " << key;
    ASSERT_EQ(v->sizes(), t.sizes()) << key;
    t.copy_(*v);
    ++n;
  };
  for (auto& it : m.named_parameters()) load(it.key(), it.value());
  for (auto& it : m.named_buffers()) load(it.key(), it.value());
  EXPECT_EQ(n, dict.size()) << "the full state dict has keys the module does not";
}

// Pieces of every rank, indexed by key: answers any range by assembling the overlapping pieces
// (as checkpoint::Reader does), and fails when some element of the range is in no piece.
class PieceReader {
 public:
  explicit PieceReader(const std::vector<std::vector<checkpoint::Piece>>& per_rank) {
    for (const auto& pieces : per_rank) {
      for (const auto& p : pieces) by_key_[p.key].push_back(p);
    }
  }
  at::Tensor read(const std::string& key, int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mu_);
    ++reads_;
    auto it = by_key_.find(key);
    TORCH_CHECK(it != by_key_.end(), "PieceReader: no piece of '", key, "'");
    TORCH_CHECK(begin <= end, "PieceReader: bad range [", begin, ", ", end, ") of ", key);
    at::Tensor out;
    std::vector<bool> covered(end - begin, false);
    for (const auto& p : it->second) {
      const int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.begin + p.data.numel());
      if (lo >= hi) continue;
      auto src = p.data.reshape({-1}).narrow(0, lo - p.begin, hi - lo);
      if (!out.defined()) out = at::empty({end - begin}, src.options());
      out.narrow(0, lo - begin, hi - lo).copy_(src);
      std::fill(covered.begin() + (lo - begin), covered.begin() + (hi - begin), true);
    }
    TORCH_CHECK(std::all_of(covered.begin(), covered.end(), [](bool c) { return c; }), "PieceReader: range [",
                begin, ", ", end, ") of '", key, "' is not covered by the saved pieces");
    if (!out.defined()) out = at::empty({0});  // an empty range
    return out;
  }
  const std::map<std::string, std::vector<checkpoint::Piece>>& by_key() const { return by_key_; }
  int reads() const { return reads_; }

 private:
  std::map<std::string, std::vector<checkpoint::Piece>> by_key_;
  std::mutex mu_;
  int reads_ = 0;
};

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace

// --- full state dict -----------------------------------------------------------------------------

TEST(FsdpFullStateDict, KeysOfTheUnwrappedModuleAndLoadsIntoAPlainModule) {
  TrainSpec spec;
  spec.steps = 5;
  const Reference gpt_ref = train_reference(make_gpt(), spec, 3);
  TrainSpec toy_spec = spec;
  toy_spec.data = Data::Vec;
  const Reference toy_ref = train_reference(make_toy(2), toy_spec, 3);
  Dict gpt_dict, toy_dict;
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    auto gpt = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, by_block());
    auto opt = make_opt(spec, gpt->parameters());
    train(gpt, *opt, spec, pg.rank(), 3);
    auto toy = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(2), pg, toy_options());
    auto toy_opt = make_opt(toy_spec, toy->parameters());
    train(toy, *toy_opt, toy_spec, pg.rank(), 3);
    auto d1 = gpt->full_state_dict(0);
    auto d2 = toy->full_state_dict(0);
    if (pg.rank() == 0) {
      gpt_dict = d1;
      toy_dict = d2;
    }
  });
  // Keys, shapes and dtypes of the unwrapped modules (parameters, tied aliases, buffers), values of
  // single-process training.
  expect_dicts_close(gpt_dict, gpt_ref.values, 1e-5, "GPT");
  expect_dicts_close(toy_dict, toy_ref.values, 1e-5, "ToyNet");
  for (const auto& it : gpt_dict) EXPECT_TRUE(it.value().is_contiguous()) << it.key();
  // They load into plain libtorch modules built from other seeds, which then compute what the
  // reference computes.
  models::GPT plain_gpt = make_gpt(/*seed=*/77);
  load_into_plain(*plain_gpt, gpt_dict);
  expect_dicts_close(named_values(*plain_gpt), gpt_ref.values, 1e-5, "plain GPT");
  models::GPT ref_gpt = make_gpt(/*seed=*/78);
  load_into_plain(*ref_gpt, gpt_ref.values);
  auto tokens = global_batch(Data::Gpt, 99, 3).x;
  EXPECT_LT(max_rel_diff(plain_gpt->forward(tokens), ref_gpt->forward(tokens)), 1e-5);
  ToyNet plain_toy = make_toy(79);
  load_into_plain(*plain_toy, toy_dict);
  expect_dicts_close(named_values(*plain_toy), toy_ref.values, 1e-5, "plain ToyNet");
}

TEST(FsdpFullStateDict, OnAnotherRankOnly) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, by_block());
    auto dict = model->full_state_dict(/*rank=*/1);
    if (pg.rank() == 1) {
      expect_dicts_close(dict, named_values(*make_gpt()), 0, "full_state_dict(1) on rank 1");
    } else {
      EXPECT_EQ(dict.size(), 0u);
    }
  });
}

TEST(FsdpGatherFullParams, ModuleHoldsTheFullWeightsWhileTheGuardLives) {
  const Dict expect = named_values(*make_toy(2));
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(2), pg, toy_options());
    auto& net = model->module();
    {
      auto guard = model->gather_full_params();
      for (const auto& it : net->named_parameters()) {
        EXPECT_TRUE(at::equal(it.value(), expect[it.key()])) << it.key() << " on rank " << pg.rank();
      }
      EXPECT_TRUE(net->v->weight.is_same(net->u->weight) || at::equal(net->v->weight, net->u->weight));
    }
    // Freed again: the module's parameters hold no full-size memory.
    for (const auto& it : net->named_parameters()) {
      EXPECT_LT(int64_t(it.value().storage().nbytes()), expect[it.key()].numel() * 4) << it.key();
    }
  });
}

class FsdpLoadFullStateDict : public ::testing::TestWithParam<int> {};

TEST_P(FsdpLoadFullStateDict, RoundTripAndTrainingFromIt) {
  const int W = GetParam();
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.steps = 4;
  // Load seed 3's values into a wrapper built from seed 8; training then matches seed 3's.
  const Dict start = named_values(*make_toy(3));
  const Reference ref = train_reference(make_toy(3), spec, W);
  run_ranks(W, [&](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(8), pg, toy_options());
    model->load_full_state_dict(start);
    auto dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, start, 0, "after load_full_state_dict");
    EXPECT_EQ(model->module()->count.item<float>(), 0.0f) << "buffers load too";
    auto opt = make_opt(spec, model->parameters());
    train(model, *opt, spec, pg.rank(), W);
    dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, "trained from the loaded state");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FsdpLoadFullStateDict, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(FsdpLoadFullStateDictErrors, WrongShapeOrMissingKeyIsNamed) {
  Dict bad = named_values(*make_toy(3));
  bad["out.weight"] = at::zeros({4, 16});
  Dict missing;
  for (const auto& it : named_values(*make_toy(3))) {
    if (it.key() != "v.alpha") missing.insert(it.key(), it.value());
  }
  for (const Dict* d : {&bad, &missing}) {
    std::vector<std::string> errors(2);
    run_ranks(2, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(8), pg, toy_options());
      try {
        model->load_full_state_dict(*d);
      } catch (const std::exception& e) {
        errors[pg.rank()] = e.what();
      }
      comm::barrier(pg);  // no rank leaves (closing its connections) while another still loads
    });
    const char* key = d == &bad ? "out.weight" : "v.alpha";
    for (const auto& e : errors) EXPECT_NE(e.find(key), std::string::npos) << "the error names " << key << ": " << e;
  }
}

// --- sharded state dict --------------------------------------------------------------------------

// (strategy at W=2 that loads what FullShard saved at W=3)
class FsdpShardedStateDict : public ::testing::TestWithParam<std::tuple<ShardingStrategy, fsdp::MeshLayout>> {};

TEST_P(FsdpShardedStateDict, SavedAtThreeLoadsAtTwo) {
  const auto [st, hybrid] = GetParam();
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.steps = 3;
  std::vector<std::vector<checkpoint::Piece>> saved(3);
  Dict saved_full;
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(4), pg, toy_options());
    auto opt = make_opt(spec, model->parameters());
    train(model, *opt, spec, pg.rank(), 3);
    const auto gathers = model->state().stats().all_gathers;
    auto pieces = model->state().sharded_state_dict();
    EXPECT_EQ(model->state().stats().all_gathers, gathers) << "a sharded state dict needs no communication";
    for (auto& p : pieces) {
      saved[pg.rank()].push_back({p.key, p.shape, p.begin, p.data.detach().clone()});
    }
    auto d = model->full_state_dict(0);
    if (pg.rank() == 0) saved_full = d;
  });
  ASSERT_GT(saved_full.size(), 0u);
  PieceReader reader(saved);
  // Every key of the full state dict except tied aliases is saved, "model/" + its name, with the
  // whole tensor's shape; the three ranks' pieces cover it exactly once.
  size_t aliases = 0;
  for (const auto& it : saved_full) {
    auto found = reader.by_key().find("model/" + it.key());
    if (found == reader.by_key().end()) {
      EXPECT_TRUE(it.key() == "u.weight" || it.key() == "v.weight") << "no pieces of " << it.key();
      ++aliases;
      continue;
    }
    std::vector<int> hits(it.value().numel(), 0);
    for (const auto& p : found->second) {
      EXPECT_EQ(p.shape, it.value().sizes().vec()) << p.key;
      for (int64_t i = 0; i < p.data.numel(); ++i) ++hits.at(p.begin + i);
    }
    EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }))
        << it.key() << ": each element saved by exactly one rank";
  }
  EXPECT_LE(aliases, 1u) << "one of the tied names is saved";
  for (const auto& [key, pieces] : reader.by_key()) {
    EXPECT_TRUE(saved_full.contains(key.substr(6))) << "a piece of an unknown tensor: " << key;
    for (const auto& p : pieces) EXPECT_EQ(p.begin + p.data.numel() <= numel_of(p.shape), true) << key;
  }

  run_ranks(2, [&, st = st, hybrid = hybrid](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(9), pg, toy_options(st, hybrid));
    model->state().load_sharded_state_dict(
        [&](const std::string& key, int64_t begin, int64_t end) { return reader.read(key, begin, end); });
    auto dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, saved_full, 0, std::string("loaded at W=2 ") + fsdp::to_string(st));
  });
  EXPECT_GT(reader.reads(), 0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpShardedStateDict,
                         ::testing::Values(std::make_tuple(ShardingStrategy::FullShard, fsdp::MeshLayout{0, 0}),
                                           std::make_tuple(ShardingStrategy::NoShard, fsdp::MeshLayout{0, 0}),
                                           std::make_tuple(ShardingStrategy::HybridShard, fsdp::MeshLayout{2, 1})),
                         [](const auto& info) { return std::string(fsdp::to_string(std::get<0>(info.param))); });

// --- the large-model path ---------------------------------------------------------------------------

class FsdpInitOnRanks : public ::testing::TestWithParam<int> {};

TEST_P(FsdpInitOnRanks, DeferredGptEqualsNormallyBuiltGptBitwise) {
  const int W = GetParam();
  const uint64_t seed = 21;
  const Dict expect = named_values(*make_gpt(seed));
  TrainSpec spec;
  spec.steps = 3;
  const Reference ref = train_reference(make_gpt(seed), spec, W);
  run_ranks(W, [&](comm::ProcessGroup& pg) {
    models::GPT gpt(tiny_gpt_options(seed).defer_init(true));
    // Nothing was materialised: each parameter is a placeholder of (at most) one element.
    for (const auto& p : gpt->parameters()) ASSERT_LE(p.storage().nbytes(), sizeof(float));
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(gpt, pg, by_block().param_init_fn(gpt->initializer(seed)));
    auto dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, expect, 0, "init on ranks, W=" + std::to_string(W));
    // And it trains like the normally built model.
    auto opt = make_opt(spec, model->parameters());
    train(model, *opt, spec, pg.rank(), W);
    dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, "trained after init on ranks");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FsdpInitOnRanks, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });
