// FullyShardedDataParallel against single-process training (same model, data and seed; each rank
// takes its slice of one global batch): every sharding strategy at world sizes 1-4, wrapped by
// block and as one unit; SGD with momentum; gradient accumulation with and without no_sync;
// global-norm clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "fsdp_testing.h"

using namespace dtrain;
using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;
using fsdp::ShardingStrategy;

namespace {

struct Config {
  ShardingStrategy strategy;
  int world;
  fsdp::MeshLayout hybrid{0, 0};  // HybridShard only
  bool wrap_blocks = true;

  fsdp::FullyShardedOptions options() const {
    auto o = fsdp::FullyShardedOptions().sharding(strategy).hybrid_layout(hybrid);
    return wrap_blocks ? by_block(o) : o.wrap_policy(fsdp::WrapPolicy::none());
  }
  fsdp::MeshLayout expected_layout() const {
    switch (strategy) {
      case ShardingStrategy::FullShard:
      case ShardingStrategy::ShardGradOp: return {1, world};
      case ShardingStrategy::NoShard: return {world, 1};
      case ShardingStrategy::HybridShard: return hybrid;
    }
    return {};
  }
  std::string name() const {
    std::ostringstream s;
    s << fsdp::to_string(strategy);
    if (strategy == ShardingStrategy::HybridShard) s << hybrid.replicate << "x" << hybrid.shard;
    s << "_W" << world << (wrap_blocks ? "_block" : "_none");
    return s.str();
  }
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name(); }

// Every strategy at W = 1..4 (HybridShard as {2, 2} at W=4, {2, 1} and {1, 2} at W=2); each
// test runs both wrap policies (by block, none).

std::vector<Config> parity_configs() {
  std::vector<Config> out;
  for (auto st : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard}) {
    for (int w = 1; w <= 4; ++w) out.push_back({st, w});
  }
  out.push_back({ShardingStrategy::HybridShard, 4, {2, 2}});
  out.push_back({ShardingStrategy::HybridShard, 2, {2, 1}});
  out.push_back({ShardingStrategy::HybridShard, 2, {1, 2}});
  return out;
}

// A test name: the layout without the wrap policy.
std::string layout_name(const Config& c) {
  const std::string n = c.name();
  return n.substr(0, n.rfind('_'));
}

// Trains the tiny GPT under FSDP on every rank and compares rank 0's full state dict with `ref`.
void expect_fsdp_matches(const Config& s, const TrainSpec& spec, const Reference& ref, double tol = 1e-5,
                         const std::function<models::GPT()>& make = [] { return make_gpt(); }) {
  run_ranks(s.world, [&](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make(), pg, s.options());
    const auto& state = model->state();
    EXPECT_EQ(state.units().size(), s.wrap_blocks ? 3u : 1u);
    EXPECT_EQ(state.groups().layout.replicate, s.expected_layout().replicate) << s.name();
    EXPECT_EQ(state.groups().layout.shard, s.expected_layout().shard) << s.name();
    // Each rank holds 1/shard of the trainable parameters (plus at most one element of padding per
    // FlatParam).
    int64_t total = 0, local = 0;
    for (const auto& p : make_gpt()->parameters()) total += p.numel();
    auto shards = model->parameters();
    for (const auto& p : shards) local += p.numel();
    const int S = s.expected_layout().shard;
    EXPECT_GE(local * S, total) << s.name();
    EXPECT_LE(local, total / S + static_cast<int64_t>(shards.size())) << s.name();

    auto opt = make_opt(spec, shards);
    train(model, *opt, spec, pg.rank(), s.world);
    auto dict = model->full_state_dict(0);
    if (pg.rank() == 0) {
      expect_dicts_close(dict, ref.values, tol, s.name());
    } else {
      EXPECT_EQ(dict.size(), 0u) << "only rank 0 keeps the full state dict (rank " << pg.rank() << ")";
    }
  });
}

}  // namespace

class FsdpParity : public ::testing::TestWithParam<Config> {};

TEST_P(FsdpParity, GptAdamWMatchesSingleProcess) {
  Config s = GetParam();
  TrainSpec spec;  // tiny GPT, 2 rows per rank, 10 AdamW steps with weight decay
  const Reference ref = train_reference(make_gpt(), spec, s.world);
  for (bool wrap_blocks : {true, false}) {
    s.wrap_blocks = wrap_blocks;
    expect_fsdp_matches(s, spec, ref);
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpParity, ::testing::ValuesIn(parity_configs()),
                         [](const auto& info) { return layout_name(info.param); });

TEST(FsdpParityFloat64, GptAdamWMatchesSingleProcessClosely) {
  // In float64 rounding is ~1e-16, so FSDP must agree with one process far more closely (2e-12
  // measured), with libtorch's default AdamW eps (see kAdamEps).
  TrainSpec spec;
  spec.adam_eps = 1e-8;
  auto make = [] {
    auto g = make_gpt();
    g->to(at::kDouble);
    return g;
  };
  for (const Config& s : {Config{ShardingStrategy::FullShard, 3}, Config{ShardingStrategy::HybridShard, 4, {2, 2}},
                          Config{ShardingStrategy::ShardGradOp, 2, {0, 0}, false}}) {
    const Reference ref = train_reference(make(), spec, s.world);
    ASSERT_EQ(ref.values["lm_head.weight"].scalar_type(), at::kDouble);
    expect_fsdp_matches(s, spec, ref, 1e-10, make);
  }
}

TEST(FsdpParityOptimizers, GptSgdMomentumMatchesSingleProcess) {
  TrainSpec spec;
  spec.opt = Opt::SgdMomentum;
  const Reference ref = train_reference(make_gpt(), spec, 3);
  expect_fsdp_matches({ShardingStrategy::FullShard, 3}, spec, ref);
}

TEST(FsdpParityOptions, WithoutPrefetchAndOneGatheredUnit) {
  // Prefetching changes when all-gathers start, never what is computed.
  TrainSpec spec;
  spec.steps = 5;
  const Reference ref = train_reference(make_gpt(), spec, 3);
  for (bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "prefetch, max_gathered_units 1" : "no prefetch");
    run_ranks(3, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<models::GPT>(
          make_gpt(), pg,
          by_block()
              .forward_prefetch(prefetch)
              .backward_prefetch(prefetch ? fsdp::BackwardPrefetch::BeforeBackward : fsdp::BackwardPrefetch::None)
              .max_gathered_units(1));
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), 3);
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, "prefetch options");
    });
  }
}

// Every backward schedule (Design note [backward memory]) against one process, W = 1..4 (3: uneven
// shards): parameters within 1e-5 after 10 AdamW steps, the same collectives per step.
class FsdpBackwardModes : public ::testing::TestWithParam<int> {};

TEST_P(FsdpBackwardModes, EveryScheduleMatchesSingleProcess) {
  const int W = GetParam();
  const int64_t L = 3;
  TrainSpec spec;
  auto make = [&] { return make_gpt(3, L); };
  const Reference ref = train_reference(make(), spec, W);
  for (const auto& mode : backward_modes()) {
    SCOPED_TRACE(mode.name());
    run_ranks(W, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<models::GPT>(make(), pg, mode.apply(by_block()));
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), W);
      // Full shard: the root gathered once per step, each block twice; one reduction per unit.
      const auto& stats = model->state().stats();
      EXPECT_EQ(stats.all_gathers, W > 1 ? spec.steps * (1 + 2 * L) : 0) << mode.name();
      EXPECT_EQ(stats.reduce_scatters, W > 1 ? spec.steps * (1 + L) : 0) << mode.name();
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, mode.name());
    });
  }
  // The lean schedule under hybrid sharding (reduce-scatter, then the replicas' all-reduce) and
  // with accumulation under no_sync (full gradients kept in the parameters, then reduced).
  const BackwardMode lean{fsdp::BackwardPrefetch::AfterBackward, false, 2};
  if (W == 4) {
    run_ranks(W, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<models::GPT>(
          make(), pg, lean.apply(by_block().sharding(ShardingStrategy::HybridShard).hybrid_layout({2, 2})));
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), W);
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, "hybrid 2x2, " + lean.name());
    });
  }
  if (W == 2 || W == 3) {
    TrainSpec acc = spec;
    acc.steps = 5;
    acc.micro = 2;
    const Reference acc_ref = train_reference(make(), acc, W);
    for (bool no_sync : {true, false}) {
      acc.no_sync = no_sync;
      run_ranks(W, [&](comm::ProcessGroup& pg) {
        auto model = fsdp::FullyShardedDataParallel<models::GPT>(make(), pg, lean.apply(by_block()));
        auto opt = make_opt(acc, model->parameters());
        train(model, *opt, acc, pg.rank(), W);
        auto dict = model->full_state_dict(0);
        if (pg.rank() == 0) {
          expect_dicts_close(dict, acc_ref.values, 1e-5, lean.name() + (no_sync ? ", no_sync" : ", 2 synced backwards"));
        }
      });
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, FsdpBackwardModes, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(FsdpParityOptions, CpuOffloadOnTheCpuRunsTheSameSteps) {
  // cpu_offload moves master shards to the CPU and gathers/reductions to the module's device; on
  // a CPU model both are the CPU, so this runs the offload code path (copies included) and must
  // train exactly like the default. (On CUDA it has not run yet: no GPU here.)
  TrainSpec spec;
  spec.steps = 4;
  const Reference ref = train_reference(make_gpt(), spec, 2);
  for (auto st : {ShardingStrategy::FullShard, ShardingStrategy::NoShard}) {
    run_ranks(2, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, by_block().sharding(st).cpu_offload(true));
      for (const auto& s : model->parameters()) EXPECT_TRUE(s.device().is_cpu());
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), 2);
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, fsdp::to_string(st));
    });
  }
}

TEST(FsdpParityOptimizers, MlpAdamWMatchesSingleProcess) {
  // The small MLP of the DDP tests as one unit (its Linear layers are not Hookable), uneven shards.
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.per_rank = 3;
  for (auto st : {ShardingStrategy::FullShard, ShardingStrategy::HybridShard}) {
    const Reference ref = train_reference(dtrain::testing::make_mlp(4), spec, 3);
    run_ranks(3, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<dtrain::testing::Mlp>(
          dtrain::testing::make_mlp(4), pg, fsdp::FullyShardedOptions().sharding(st).hybrid_layout({1, 3}));
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), 3);
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, fsdp::to_string(st));
    });
  }
}

// --- gradient accumulation ----------------------------------------------------------------------

// (strategy, world); each test accumulates with the first micro-batch under no_sync and without.
class FsdpAccumulation : public ::testing::TestWithParam<std::tuple<ShardingStrategy, int>> {};

TEST_P(FsdpAccumulation, TwoMicroBatchesMatchOneBigBatch) {
  const auto [st, W] = GetParam();
  TrainSpec spec;
  spec.steps = 5;
  spec.micro = 2;
  const Reference ref = train_reference(make_gpt(), spec, W);
  for (bool no_sync : {true, false}) {
    SCOPED_TRACE(no_sync ? "first micro-batch under no_sync" : "two synced backwards");
    spec.no_sync = no_sync;
    expect_fsdp_matches({st, W, {1, W}, true}, spec, ref);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FsdpAccumulation,
    ::testing::Combine(::testing::Values(ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                         ShardingStrategy::NoShard, ShardingStrategy::HybridShard),
                       ::testing::Values(2, 3)),
    StrategyWorldName());

TEST(FsdpNoSync, BackwardUnderNoSyncReducesNothing) {
  run_ranks(2, [](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, by_block());
    auto b = global_batch(Data::Gpt, 0, 4).slice(pg.rank() * 2, 2);
    const auto before = model->state().stats().reduce_scatters;
    {
      auto guard = model->no_sync();
      loss_of(model->forward(b.x), b.y).backward();
    }
    EXPECT_EQ(model->state().stats().reduce_scatters, before) << "no_sync backward must not reduce";
    // The full local gradients stay in the module's parameters (as PyTorch's FSDP).
    auto& gpt = model->module();
    ASSERT_TRUE(gpt->lm_head->weight.grad().defined());
    EXPECT_EQ(gpt->lm_head->weight.grad().sizes(), (std::vector<int64_t>{kVocab, 16}));
    ASSERT_TRUE(gpt->blocks()[0]->fc->weight.grad().defined());
    EXPECT_EQ(gpt->blocks()[0]->fc->weight.grad().sizes(), (std::vector<int64_t>{64, 16}));
    // ... and differ between ranks (different data, nothing averaged).
    auto g = gpt->lm_head->weight.grad().reshape({-1}).contiguous();
    auto all = at::empty({2 * g.numel()});
    comm::all_gather(pg, all, g);
    EXPECT_FALSE(at::allclose(all.narrow(0, 0, g.numel()), all.narrow(0, g.numel(), g.numel())));
    // A synced backward then reduces and drops them.
    loss_of(model->forward(b.x), b.y).backward();
    EXPECT_GT(model->state().stats().reduce_scatters, before);
    EXPECT_FALSE(gpt->lm_head->weight.grad().defined()) << "full gradients are dropped after the reduction";
    EXPECT_FALSE(gpt->blocks()[0]->fc->weight.grad().defined());
  });
}

// --- clipping ------------------------------------------------------------------------------------

class FsdpClip : public ::testing::TestWithParam<Config> {};

TEST_P(FsdpClip, NormAndClippedStepEqualSingleProcess) {
  const Config s = GetParam();
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE("norm type " + std::to_string(norm_type));
    TrainSpec spec;
    spec.steps = 3;
    spec.opt = Opt::Sgd;
    spec.clip = norm_type == 2.0 ? 0.05 : 0.002;
    spec.clip_type = norm_type;
    const Reference ref = train_reference(make_gpt(), spec, s.world);
    ASSERT_EQ(ref.log.norms.size(), 3u);
    for (double n : ref.log.norms) ASSERT_GT(n, spec.clip * 2) << "clipping must be triggered";
    run_ranks(s.world, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, s.options());
      auto opt = make_opt(spec, model->parameters());
      auto log = train(model, *opt, spec, pg.rank(), s.world);
      ASSERT_EQ(log.norms.size(), ref.log.norms.size());
      for (size_t i = 0; i < log.norms.size(); ++i) {
        EXPECT_NEAR(log.norms[i], ref.log.norms[i], 1e-5 * ref.log.norms[i])
            << s.name() << " step " << i << " rank " << pg.rank();
      }
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, s.name());
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpClip,
                         ::testing::Values(Config{ShardingStrategy::FullShard, 1}, Config{ShardingStrategy::FullShard, 2},
                                           Config{ShardingStrategy::FullShard, 3},
                                           Config{ShardingStrategy::HybridShard, 4, {2, 2}},
                                           Config{ShardingStrategy::NoShard, 2}),
                         [](const auto& info) { return layout_name(info.param); });
