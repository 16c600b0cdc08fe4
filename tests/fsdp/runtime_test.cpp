// What FSDP does during an iteration: bf16 mixed precision with fp32 masters, activation
// checkpointing inside FSDP units (no extra all-gather), and memory: units freed after their use,
// kept through backward by ShardGradOp, full gradients dropped, a bound on the peak.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/recompute/checkpoint.h"
#include "fsdp_testing.h"

using namespace dtrain;
using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;
using fsdp::ShardingStrategy;

namespace {

// Runs `fn` inside the block's forward, innermost (after FSDP gathered and any recomputation hook).
uint64_t inside_forward(models::GPTBlock block, std::function<void()> fn) {
  return block->forward_hooks().add(nn::HookOrder::User, [fn](const nn::Tensors& in, const nn::ForwardBody& next) {
    fn();
    return next(in);
  });
}

int64_t bytes_of(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += t.numel() * t.element_size();
  return n;
}

std::string unit_states(const fsdp::FullyShardedState& s) {
  std::ostringstream o;
  for (const auto& u : s.units()) {
    o << " [" << (u->name.empty() ? "root" : u->name) << ": " << fsdp::to_string(u->state())
      << (u->gathered() ? ", gathered" : "") << (u->gathering() ? ", gathering" : "") << "]";
  }
  return o.str();
}

}  // namespace

// --- mixed precision -----------------------------------------------------------------------------

class FsdpMixedPrecision : public ::testing::TestWithParam<std::tuple<ShardingStrategy, at::ScalarType>> {};

TEST_P(FsdpMixedPrecision, Bf16TracksFp32WithFp32Masters) {
  const auto [st, reduce] = GetParam();
  const int W = 2;
  TrainSpec spec;
  run_ranks(W, [&, st = st, reduce = reduce](comm::ProcessGroup& pg) {
    auto base = fsdp::FullyShardedOptions().sharding(st).hybrid_layout({2, 1});
    auto fp32 = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, by_block(base));
    auto opt32 = make_opt(spec, fp32->parameters());
    const auto log32 = train(fp32, *opt32, spec, pg.rank(), W);

    auto mp = fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(reduce).output_dtype(at::kFloat);
    auto bf16 = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, by_block(base).mixed_precision(mp));
    // Compute runs in bf16: inside a block's forward its weights and the root's are bf16.
    auto& gpt = bf16->module();
    std::vector<at::ScalarType> seen;
    inside_forward(gpt->blocks()[1], [&] {
      seen.push_back(gpt->blocks()[1]->qkv->weight.scalar_type());
      seen.push_back(gpt->lm_head->weight.scalar_type());
    });
    auto opt16 = make_opt(spec, bf16->parameters());
    {
      // One extra iteration without a step: the output's dtype, the compute dtype.
      auto b = global_batch(Data::Gpt, 0, 2 * W).slice(2 * pg.rank(), 2);
      auto out = bf16->forward(b.x);
      EXPECT_EQ(out.scalar_type(), at::kFloat) << "output_dtype";
      loss_of(out, b.y).backward();
      ASSERT_FALSE(seen.empty());
      for (auto t : seen) EXPECT_EQ(t, at::kBFloat16) << "compute dtype inside the forward";
      opt16->zero_grad();
    }
    const auto log16 = train(bf16, *opt16, spec, pg.rank(), W);

    ASSERT_EQ(log16.losses.size(), log32.losses.size());
    double max_rel = 0;
    for (size_t i = 0; i < log32.losses.size(); ++i) {
      const double rel = std::abs(log16.losses[i] - log32.losses[i]) / log32.losses[i];
      max_rel = std::max(max_rel, rel);
      EXPECT_LT(rel, 0.02) << "step " << i << ": bf16 " << log16.losses[i] << " vs fp32 " << log32.losses[i];
    }
    EXPECT_GT(max_rel, 0.0) << "the bf16 run computed exactly what fp32 did: was bf16 used at all?";
    // fp32 masters: what the optimizer steps, their gradients, and the full state dict.
    for (const auto& p : bf16->parameters()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
    }
    for (const auto& s : bf16->state().shards()) EXPECT_EQ(s.scalar_type(), at::kFloat);
    auto dict = bf16->full_state_dict(0);
    for (const auto& it : dict) EXPECT_EQ(it.value().scalar_type(), at::kFloat) << it.key();
  });
}

INSTANTIATE_TEST_SUITE_P(Policies, FsdpMixedPrecision,
                         ::testing::Combine(::testing::Values(ShardingStrategy::FullShard, ShardingStrategy::HybridShard),
                                            ::testing::Values(at::kFloat, at::kBFloat16)),
                         [](const auto& info) {
                           return std::string(fsdp::to_string(std::get<0>(info.param))) + "_reduce_" +
                                  (std::get<1>(info.param) == at::kFloat ? "fp32" : "bf16");
                         });

// --- activation checkpointing --------------------------------------------------------------------

class FsdpActivationCheckpointing : public ::testing::TestWithParam<std::tuple<ShardingStrategy, int>> {};

TEST_P(FsdpActivationCheckpointing, SameGradientsAndNoExtraAllGathers) {
  const auto [st, W] = GetParam();
  run_ranks(W, [&, st = st, W = W](comm::ProcessGroup& pg) {
    const auto opts = by_block(fsdp::FullyShardedOptions().sharding(st));
    auto plain = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(), pg, opts);
    models::GPT recomputed(tiny_gpt_options());  // the model knows nothing of how it is trained
    recompute::checkpoint_modules(*recomputed, recompute::of_type<models::GPTBlockImpl>());
    auto ckpt = fsdp::FullyShardedDataParallel<models::GPT>(recomputed, pg, opts);
    auto opt_plain = make_opt(Opt::AdamW, plain->parameters());
    auto opt_ckpt = make_opt(Opt::AdamW, ckpt->parameters());
    // Calls of block 0's forward body; in the checkpointed model, whether its unit was gathered
    // each time (the recomputation in backward must run inside FSDP's gathered parameters).
    int calls_plain = 0, calls_ckpt = 0;
    std::vector<bool> ckpt_gathered;
    const auto& cstate = ckpt->state();
    const int unit0 = unit_index(cstate, "blocks.0");
    ASSERT_GE(unit0, 0) << cstate.describe();
    inside_forward(plain->module()->blocks()[0], [&] { ++calls_plain; });
    inside_forward(ckpt->module()->blocks()[0], [&] {
      ++calls_ckpt;
      ckpt_gathered.push_back(cstate.units()[unit0]->gathered());
    });
    const int steps = 4;
    for (int t = 0; t < steps; ++t) {
      auto b = global_batch(Data::Gpt, t, 2 * W).slice(2 * pg.rank(), 2);
      opt_plain->zero_grad();
      opt_ckpt->zero_grad();
      const auto s0 = plain->state().stats();
      loss_of(plain->forward(b.x), b.y).backward();
      const auto s1 = plain->state().stats();
      const auto c0 = cstate.stats();
      loss_of(ckpt->forward(b.x), b.y).backward();
      const auto c1 = cstate.stats();
      EXPECT_EQ(c1.all_gathers - c0.all_gathers, s1.all_gathers - s0.all_gathers)
          << "step " << t << ": recomputation must reuse the parameters gathered for backward";
      EXPECT_EQ(c1.reduce_scatters - c0.reduce_scatters, s1.reduce_scatters - s0.reduce_scatters) << "step " << t;
      if (W > 1) {
        EXPECT_GT(s1.all_gathers - s0.all_gathers, 0);
      }
      auto gp = plain->parameters(), gc = ckpt->parameters();
      ASSERT_EQ(gp.size(), gc.size());
      for (size_t i = 0; i < gp.size(); ++i) {
        ASSERT_TRUE(gc[i].grad().defined() && gp[i].grad().defined());
        EXPECT_LT(max_rel_diff(gc[i].grad(), gp[i].grad()), 1e-6) << "shard " << i << " step " << t;
      }
      opt_plain->step();
      opt_ckpt->step();
    }
    EXPECT_EQ(calls_plain, steps);
    EXPECT_EQ(calls_ckpt, 2 * steps) << "the checkpointed block runs again in backward";
    for (size_t i = 0; i < ckpt_gathered.size(); ++i) EXPECT_TRUE(ckpt_gathered[i]) << "call " << i;
    auto dp = plain->full_state_dict(0), dc = ckpt->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dc, dp, 1e-6, "checkpointed vs not");
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpActivationCheckpointing,
                         ::testing::Values(std::make_tuple(ShardingStrategy::FullShard, 2),
                                           std::make_tuple(ShardingStrategy::FullShard, 3),
                                           std::make_tuple(ShardingStrategy::ShardGradOp, 2)),
                         StrategyWorldName());

// --- memory --------------------------------------------------------------------------------------

class FsdpMemory : public ::testing::TestWithParam<std::tuple<ShardingStrategy, int>> {};

// What the pool may keep on Gloo beyond the schedule's parameters and gradients (Design note
// [buffers reused], util/block_pool.h): the root's reduce-scatter workspace and output, and
// block-sized workspaces for one all-gather and up to two reduce-scatters in flight.
int64_t gloo_workspaces(int W, int64_t root, int64_t block) { return root + root / W + 3 * block; }

TEST_P(FsdpMemory, UnitsFreedAfterUseGradientsSharded) {
  const auto [st, W] = GetParam();
  const int64_t L = 6;
  run_ranks(W, [&, st = st, W = W](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(3, L), pg,
                                                             by_block(fsdp::FullyShardedOptions().sharding(st)));
    const auto& state = model->state();
    auto& gpt = model->module();
    ASSERT_EQ(state.units().size(), size_t(L + 1));
    const int max_gathered = state.options().max_gathered_units();
    const bool full = st == ShardingStrategy::FullShard;

    // Sharded at rest: no unit gathered, the module's parameters hold no full-size memory.
    for (const auto& u : state.units()) EXPECT_FALSE(u->gathered()) << "after construction:" << unit_states(state);
    const Dict unwrapped = named_values(*make_gpt(3, L));
    for (const auto& it : gpt->named_parameters()) {
      const int64_t full_bytes = unwrapped[it.key()].numel() * 4;
      EXPECT_LT(int64_t(it.value().storage().nbytes()), full_bytes) << it.key() << " holds full memory";
    }
    const int64_t shard_bytes = bytes_of(state.shards());
    EXPECT_EQ(state.owned_bytes(), shard_bytes) << "at rest: the master shards only";

    // Inside block k's forward: k gathered; a FullShard block k-1 already freed, a ShardGradOp one
    // kept; never more than max_gathered_units nested units gathered besides the running one.
    std::vector<std::string> problems;
    for (int64_t k = 0; k < L; ++k) {
      inside_forward(gpt->blocks()[k], [&, k] {
        if (!at::GradMode::is_enabled()) return;
        const int self = unit_index(state, "blocks." + std::to_string(k));
        if (!state.units()[self]->gathered()) problems.push_back("block " + std::to_string(k) + " runs ungathered");
        if (k > 0) {
          const bool prev = state.units()[unit_index(state, "blocks." + std::to_string(k - 1))]->gathered();
          if (prev != !full) problems.push_back("in block " + std::to_string(k) + "'s forward block " + std::to_string(k - 1) +
                                                (prev ? " is still gathered" : " is not gathered"));
        }
        int gathered = 0;
        for (size_t i = 1; i < state.units().size(); ++i) gathered += state.units()[i]->gathered() || state.units()[i]->gathering();
        if (full && gathered > max_gathered + 1) {
          problems.push_back("in block " + std::to_string(k) + "'s forward " + std::to_string(gathered) +
                             " nested units are gathered");
        }
      });
    }

    int64_t all_full = 0, largest_block = 0;
    for (size_t i = 0; i < state.units().size(); ++i) {
      all_full += state.units()[i]->full_bytes();
      if (i > 0) largest_block = std::max(largest_block, state.units()[i]->full_bytes());
    }
    const int64_t root_full = state.units()[0]->full_bytes();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (int t = 0; t < 3; ++t) {
      const auto before = state.stats();
      model->state().reset_peak();
      opt.zero_grad();
      auto b = global_batch(Data::Gpt, t, 2 * W).slice(2 * pg.rank(), 2);
      auto loss = loss_of(model->forward(b.x), b.y);
      // Between forward and backward: FullShard freed every block, ShardGradOp kept them all; the
      // root stays gathered until its backward.
      EXPECT_TRUE(state.units()[0]->gathered()) << "after forward:" << unit_states(state);
      for (size_t i = 1; i < state.units().size(); ++i) {
        EXPECT_EQ(state.units()[i]->gathered(), !full) << "after forward:" << unit_states(state);
        EXPECT_EQ(state.units()[i]->state(), fsdp::Unit::State::Forwarded) << "after forward:" << unit_states(state);
      }
      loss.backward();
      for (const auto& u : state.units()) EXPECT_FALSE(u->gathered()) << "after backward:" << unit_states(state);
      for (const auto& it : gpt->named_parameters()) {
        EXPECT_FALSE(it.value().grad().defined()) << it.key() << ": full gradient kept after backward";
      }
      int64_t grad_bytes = 0;
      for (const auto& p : model->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        grad_bytes += p.grad().numel() * p.grad().element_size();
      }
      EXPECT_EQ(grad_bytes, bytes_of(model->parameters()));
      const int64_t rest = shard_bytes + grad_bytes;
      // After backward: the shards and their gradients, nothing gathered and no full gradient; the
      // rest is free blocks the BlockPool keeps for the next step (Design note [buffers reused]).
      EXPECT_EQ(state.owned_bytes() - state.pooled_bytes(), rest)
          << "after backward only shards, their gradients and the pool's free blocks are owned";
      // Collectives per iteration: FullShard gathers the root once and every block twice (forward,
      // backward); ShardGradOp every unit once; one reduction per unit.
      const auto after = state.stats();
      EXPECT_EQ(after.all_gathers - before.all_gathers, full ? 1 + 2 * L : 1 + L) << "step " << t;
      EXPECT_EQ(after.reduce_scatters - before.reduce_scatters, 1 + L) << "step " << t;
      if (full) {
        // Peak: shards and their gradients, the root's parameters and gradients, and a bounded
        // number of blocks' parameters and gradients (running + prefetched + being reduced), and
        // on Gloo the collectives' workspaces (gloo_workspaces); far below everything gathered at
        // once.
        const int64_t bound = rest + 2 * root_full + (max_gathered + 1) * 2 * largest_block +
                              gloo_workspaces(W, root_full, largest_block);
        ASSERT_LT(bound, rest + 2 * all_full) << "the bound must be meaningful";
        EXPECT_LE(state.peak_owned_bytes(), bound) << "step " << t << ": peak " << state.peak_owned_bytes()
                                                   << ", shards+grads " << rest << ", root " << root_full
                                                   << ", block " << largest_block;
        EXPECT_GT(state.peak_owned_bytes(), rest + root_full) << "the peak counts the gathered parameters";
      }
      opt.step();
    }
    for (const auto& p : problems) ADD_FAILURE() << p;
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpMemory,
                         ::testing::Values(std::make_tuple(ShardingStrategy::FullShard, 2),
                                           std::make_tuple(ShardingStrategy::FullShard, 3),
                                           std::make_tuple(ShardingStrategy::ShardGradOp, 2)),
                         StrategyWorldName());

// --- backward schedules: memory (Design note [backward memory]) ------------------------------------

// Per-rank peak of the bytes FSDP owns in a full-shard step, for every backward schedule, against
// the model's own figures: the shards and their gradients ("rest"), the root's parameters and
// gradient buffer (gathered from the root's forward to the end of backward: its embeddings get
// their gradients last), mode.block_buffers block-sized buffers (a block's full parameters or its
// flat gradient buffer), and the reduce-scatter output (1/S of a block) of each reduction in
// flight: two while one overlaps the next unit's backward, else one.
class FsdpBackwardMemory : public ::testing::TestWithParam<int> {};

TEST_P(FsdpBackwardMemory, PeakIsWhatTheScheduleHolds) {
  const int W = GetParam();
  const int64_t L = 6;
  const auto modes = backward_modes();
  std::vector<int64_t> peaks(modes.size());
  int64_t block = 0;
  for (size_t m = 0; m < modes.size(); ++m) {
    const auto& mode = modes[m];
    run_ranks(W, [&](comm::ProcessGroup& pg) {
      auto model = fsdp::FullyShardedDataParallel<models::GPT>(make_gpt(3, L), pg, mode.apply(by_block()));
      const auto& state = model->state();
      int64_t largest = 0;
      for (size_t i = 1; i < state.units().size(); ++i) largest = std::max(largest, state.units()[i]->full_bytes());
      const int64_t root = state.units()[0]->full_bytes();
      ASSERT_GT(largest, root) << "the figures below take the blocks as the largest units";
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      for (int t = 0; t < 3; ++t) {  // step 0 creates the shards' gradients; 1 and 2 are measured
        // Zeroed in place, so the shards' gradients are held through backward on every libtorch
        // (2.x's zero_grad() frees them: set_to_none defaults to true there, not in 1.13).
        for (auto& p : model->parameters()) {
          if (p.grad().defined()) p.mutable_grad().zero_();
        }
        model->state().reset_peak();
        auto b = global_batch(Data::Gpt, t, 2 * W).slice(2 * pg.rank(), 2);
        loss_of(model->forward(b.x), b.y).backward();
        opt.step();
        if (t == 0) continue;
        const int64_t rest = bytes_of(state.shards()) + bytes_of(model->parameters());  // shards + their grads
        const int64_t held = rest + 2 * root + mode.block_buffers * largest;
        const int64_t in_flight = (mode.overlap_reduction ? 2 : 1) * largest / W + gloo_workspaces(W, root, largest);
        const int64_t peak = state.peak_owned_bytes();
        const std::string where = mode.name() + " step " + std::to_string(t) + " rank " + std::to_string(pg.rank()) +
                                  ": rest " + std::to_string(rest) + ", root " + std::to_string(root) + ", block " +
                                  std::to_string(largest);
        EXPECT_GE(peak, held) << where << ": less than the schedule holds (a prefetch or an overlap skipped?)";
        EXPECT_LE(peak, held + in_flight) << where;
        if (pg.rank() == 0 && t == 2) {
          peaks[m] = peak;
          block = largest;
        }
      }
    });
  }
  // The lean schedule (AfterBackward, serial reductions) stays within the shards + the largest
  // unit's parameters and gradients + the root's (kept through backward) + one reduce-scatter
  // output; the default holds two blocks more (the prefetched parameters, the overlapped
  // reduction's gradient buffer).
  const auto index = [&](fsdp::BackwardPrefetch p, bool overlap) {
    for (size_t m = 0; m < modes.size(); ++m) {
      if (modes[m].prefetch == p && modes[m].overlap_reduction == overlap) return m;
    }
    return modes.size();
  };
  const size_t lean = index(fsdp::BackwardPrefetch::AfterBackward, false);
  const size_t def = index(fsdp::FullyShardedOptions().backward_prefetch(), fsdp::FullyShardedOptions().overlap_reduction());
  ASSERT_LT(lean, modes.size());
  ASSERT_LT(def, modes.size());
  EXPECT_GE(peaks[def] - peaks[lean], 2 * block + block / W) << "default " << peaks[def] << ", lean " << peaks[lean];
}

INSTANTIATE_TEST_SUITE_P(Worlds, FsdpBackwardMemory, ::testing::Values(2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });
