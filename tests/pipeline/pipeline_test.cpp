// Pipeline parallelism: schedules as tables (simulated), the runtime against one process (same
// model, same global batch, AdamW, fp32), pipeline x data parallel, and bad input.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/models/gpt.h"
#include "dtrain/models/gpt_stages.h"
#include "dtrain/parallel/layout.h"
#include "dtrain/pipeline/pipeline.h"
#include "dtrain/pipeline/schedule.h"
#include "dtrain/pipeline/sharded_stages.h"
#include "dtrain/optim/clip_grad.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;
using pipeline::Kind;
using pipeline::Shape;

namespace {

// ---- schedules ----

TEST(PipelineSchedule, EveryScheduleFinishesAndKeepsItsMemoryBound) {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 8; ++m) {
      auto g = pipeline::simulate(pipeline::gpipe({p, 1, m}));
      auto f = pipeline::simulate(pipeline::one_f_one_b({p, 1, m}));
      EXPECT_EQ(g.peak_alive[0], m) << "gpipe p=" << p << " m=" << m;
      EXPECT_EQ(f.peak_alive[0], std::min(p, m)) << "1f1b p=" << p << " m=" << m;
      // With backward = 2 forwards, 1F1B's idle time is the bubble (p-1)/(m+p-1) exactly.
      EXPECT_NEAR(f.idle_fraction, f.ideal_idle_fraction, 1e-12) << "p=" << p << " m=" << m;
      EXPECT_NEAR(g.idle_fraction, g.ideal_idle_fraction, 1e-12) << "p=" << p << " m=" << m;
      for (int v = 2; v <= 3 && p > 1; ++v) {
        if (m % p != 0) continue;
        auto i = pipeline::simulate(pipeline::interleaved_1f1b({p, v, m}));
        EXPECT_LE(i.idle_fraction, f.idle_fraction + 1e-12) << "interleaved p=" << p << " v=" << v << " m=" << m;
      }
    }
  }
  auto i = pipeline::simulate(pipeline::interleaved_1f1b({4, 2, 8}));
  auto f = pipeline::simulate(pipeline::one_f_one_b({4, 1, 8}));
  EXPECT_LT(i.idle_fraction, f.idle_fraction);
}

TEST(PipelineSchedule, DescribePrintsTheTable) {
  const std::string text = pipeline::describe(pipeline::one_f_one_b({2, 1, 3}));
  EXPECT_NE(text.find("rank 0 | F0"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1 | .   F0  B0  -"), std::string::npos) << text;
  EXPECT_NE(text.find("ideal bubble 25%"), std::string::npos) << text;
  EXPECT_NE(pipeline::describe(pipeline::interleaved_1f1b({2, 2, 2})).find("F0.s2"), std::string::npos);
}

TEST(PipelineSchedule, BadSchedulesAreErrors) {
  auto throws = [](auto fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one saying " << part;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  throws([] { pipeline::make_schedule("zigzag", {2, 1, 2}); }, "unknown pipeline schedule 'zigzag'");
  throws([] { pipeline::make_schedule("1f1b", {2, 2, 2}); }, "needs --schedule interleaved");
  throws([] { pipeline::make_schedule("interleaved", {2, 1, 2}); }, "at least 2");
  throws([] { pipeline::make_schedule("interleaved", {2, 2, 3}); }, "multiple of the pipeline ranks (2)");
  // Two ranks whose orders cross: rank 0 wants B0 (from rank 1) before F1; rank 1 wants F1 before B0.
  pipeline::Schedule crossed{"crossed", {2, 1, 2}, {}};
  crossed.per_rank = {{{Kind::kForward, 0, 0}, {Kind::kBackward, 0, 0}, {Kind::kForward, 0, 1}, {Kind::kBackward, 0, 1}},
                      {{Kind::kForward, 1, 0}, {Kind::kForward, 1, 1}, {Kind::kBackward, 1, 0}, {Kind::kBackward, 1, 1}}};
  throws([&] { pipeline::simulate(crossed); }, "cannot finish (a deadlock): rank 0 at B0, rank 1 at F1");
  pipeline::Schedule missing = pipeline::gpipe({2, 1, 2});
  missing.per_rank[1].pop_back();
  throws([&] { pipeline::simulate(missing); }, "7 actions for 8");
  pipeline::Schedule misplaced = pipeline::gpipe({2, 1, 1});
  std::swap(misplaced.per_rank[0], misplaced.per_rank[1]);
  throws([&] { pipeline::simulate(misplaced); }, "lives on rank 1");
}

// ---- the runtime against one process ----

constexpr int kSteps = 10;
constexpr int kBatch = 12;

torch::nn::Sequential make_mlp(uint64_t seed) {
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  torch::manual_seed(seed);
  // 7 children: not divisible by 2, 3 or 4 stages.
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                               torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
}

std::pair<at::Tensor, at::Tensor> batch_of(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({rows, 8}, gen), at::randn({rows, 4}, gen)};
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); }

// AdamW (the check) and SGD (which, unlike Adam, also sees a gradient off by a constant
// factor, such as a loss not divided by the micro-batches).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(bool sgd, std::vector<at::Tensor> params) {
  if (sgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
}

std::map<std::string, at::Tensor> reference_mlp(std::vector<double>* losses, bool sgd = false) {
  auto model = make_mlp(7);
  auto opt = make_optimizer(sgd, model->parameters());
  for (int t = 0; t < kSteps; ++t) {
    opt->zero_grad();
    auto [x, y] = batch_of(t, kBatch);
    auto loss = mse(model->forward(x), y);
    loss.backward();
    opt->step();
    losses->push_back(loss.item<double>());
  }
  std::map<std::string, at::Tensor> out;
  for (auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct Case {
  std::string schedule;
  int pp, v, m;
};
std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.schedule + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) + "_m" + std::to_string(c.m);
}

class PipelineParity : public ::testing::TestWithParam<Case> {};

// Every rank's stage parameters equal one process's after 10 AdamW steps on the same batches, and
// every rank sees the same loss as one process.
TEST_P(PipelineParity, SequentialEqualsOneProcess) {
  const Case c = GetParam();
  for (bool sgd : {false, true}) {
    std::vector<double> ref_losses;
    const auto ref = reference_mlp(&ref_losses, sgd);
    std::mutex mu;
    run_ranks(c.pp, [&](comm::ProcessGroup& pg) {
      auto model = make_mlp(7);
      pipeline::Pipeline pipe(pipeline::split_sequential(model, c.pp * c.v), pg, mse,
                              pipeline::PipelineOptions().schedule(c.schedule).microbatches(c.m).virtual_stages(c.v));
      auto opt = make_optimizer(sgd, pipe.parameters());
      for (int t = 0; t < kSteps; ++t) {
        opt->zero_grad();
        auto [x, y] = batch_of(t, kBatch);
        const double loss = pipe.step(x, y);
        opt->step();
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_NEAR(loss, ref_losses[t], 1e-6 * std::abs(ref_losses[t]) + 1e-7)
            << (sgd ? "sgd" : "adamw") << " rank " << pg.rank() << " step " << t;
      }
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_FALSE(pipe.named_parameters().empty());
      for (auto& [name, p] : pipe.named_parameters()) {
        ASSERT_TRUE(ref.count(name)) << name;
        EXPECT_LT((p - ref.at(name)).abs().max().item<double>(), 1e-5)
            << (sgd ? "sgd " : "adamw ") << name << " on rank " << pg.rank();
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineParity,
                         ::testing::Values(Case{"gpipe", 2, 1, 4}, Case{"gpipe", 3, 1, 3}, Case{"1f1b", 2, 1, 4},
                                           Case{"1f1b", 3, 1, 6}, Case{"1f1b", 4, 1, 12},
                                           Case{"1f1b", 4, 1, 2},   // fewer micro-batches than stages
                                           Case{"gpipe", 4, 1, 1},  // one micro-batch
                                           Case{"interleaved", 2, 2, 4}, Case{"interleaved", 3, 2, 6},
                                           Case{"1f1b", 1, 1, 3}),
                         name_of);

models::GPT make_gpt(int layers) {
  std::lock_guard<std::mutex> lock(dtrain::testing::init_mutex());
  return models::GPT(models::GPTOptions().vocab_size(32).seq_len(8).layers(layers).d_model(16).heads(2).seed(11));
}

std::pair<at::Tensor, at::Tensor> tokens_of(int step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + step);
  auto all = at::randint(0, 32, {rows, 9}, gen);
  return {all.narrow(1, 0, 8).contiguous(), all.narrow(1, 1, 8).contiguous()};
}

// The GPT cut by layer counts (5 layers: 3 + 2, 2 + 2 + 1, and 4 interleaved stages).
TEST(PipelineGpt, EveryScheduleEqualsOneProcess) {
  const int layers = 5;
  auto model = make_gpt(layers);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  std::vector<double> ref_losses;
  for (int t = 0; t < kSteps; ++t) {
    opt.zero_grad();
    auto [x, y] = tokens_of(t, kBatch);
    auto loss = model->loss(x, y);
    loss.backward();
    opt.step();
    ref_losses.push_back(loss.item<double>());
  }
  std::map<std::string, at::Tensor> ref;
  for (auto& p : model->named_parameters()) ref[p.key()] = p.value().detach().clone();
  for (const Case& c : {Case{"1f1b", 2, 1, 4}, Case{"gpipe", 3, 1, 3}, Case{"interleaved", 2, 2, 2}}) {
    std::mutex mu;
    std::map<std::string, int> covered;
    run_ranks(c.pp, [&](comm::ProcessGroup& pg) {
      auto mine = make_gpt(layers);
      pipeline::Pipeline pipe(models::gpt_stages(mine, c.pp * c.v), pg, models::gpt_loss,
                              pipeline::PipelineOptions().schedule(c.schedule).microbatches(c.m).virtual_stages(c.v));
      torch::optim::AdamW o(pipe.parameters(), torch::optim::AdamWOptions(3e-3));
      for (int t = 0; t < kSteps; ++t) {
        o.zero_grad();
        auto [x, y] = tokens_of(t, kBatch);
        const double loss = pipe.step(x, y);
        o.step();
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_NEAR(loss, ref_losses[t], 1e-5) << c.schedule << " rank " << pg.rank() << " step " << t;
      }
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [name, p] : pipe.named_parameters()) {
        ASSERT_TRUE(ref.count(name)) << name;
        ++covered[name];
        EXPECT_LT((p - ref.at(name)).abs().max().item<double>(), 1e-5) << c.schedule << " " << name;
      }
    });
    EXPECT_EQ(covered.size(), ref.size()) << c.schedule << ": every parameter lives on one rank";
    for (auto& [name, n] : covered) EXPECT_EQ(n, 1) << name;
  }
}

// PP2 x DDP2 at W = 4 (parallel::Layout{replicate 2, shard 1, pipeline 2}): each data-parallel
// rank takes half the global batch; gradients averaged over the data-parallel group.
TEST(PipelineWithDataParallel, Pp2Dp2EqualsOneProcess) {
  std::vector<double> ref_losses;
  const auto ref = reference_mlp(&ref_losses);
  std::mutex mu;
  run_ranks(4, [&](comm::ProcessGroup& pg) {
    const auto groups = parallel::make_groups(pg, parallel::Layout{2, 1, 2});
    ASSERT_EQ(groups.pipeline.size(), 2);
    ASSERT_EQ(groups.data.size(), 2);
    const int dp_rank = groups.data.rank(), dp = groups.data.size();
    auto model = make_mlp(7);
    pipeline::Pipeline pipe(pipeline::split_sequential(model, 2), groups.pipeline, mse,
                            pipeline::PipelineOptions().schedule("1f1b").microbatches(3));
    torch::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int t = 0; t < kSteps; ++t) {
      opt.zero_grad();
      auto [x, y] = batch_of(t, kBatch);
      const int64_t per = kBatch / dp;
      double loss = pipe.step(x.narrow(0, dp_rank * per, per), y.narrow(0, dp_rank * per, per));
      pipeline::average_gradients(pipe.parameters(), groups.data);
      opt.step();
      auto l = at::tensor({loss}, at::kDouble);
      comm::all_reduce(groups.data, l, comm::AllReduceOptions().op(comm::ReduceOp::Avg));
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_NEAR(l.item<double>(), ref_losses[t], 1e-6) << "rank " << pg.rank() << " step " << t;
    }
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [name, p] : pipe.named_parameters())
      EXPECT_LT((p - ref.at(name)).abs().max().item<double>(), 1e-5) << name << " on rank " << pg.rank();
  });
}

// PP2 x FSDP at D = 2 and 3 (W = 4, 6; the stages' element counts divide by neither, so shards are
// padded): each stage sharded over its data-parallel group (Design note [sharded stages]),
// gathered by the first forward of a step, reduced once, stepped as shards; with clipping by the
// global norm over the world. Equal to one process; between steps only shards exist.
TEST(PipelineWithDataParallel, Pp2TimesShardedStagesEqualsOneProcess) {
  for (int dp : {2, 3}) {
    SCOPED_TRACE("pp 2 x fsdp " + std::to_string(dp));
    // The reference, clipped as torch::nn::utils::clip_grad_norm_ would (max 0.05: it clips).
    std::vector<double> ref_losses;
    auto model_ref = make_mlp(7);
    torch::optim::AdamW opt_ref(model_ref->parameters(), torch::optim::AdamWOptions(1e-2));
    std::vector<double> ref_norms;
    for (int t = 0; t < kSteps; ++t) {
      opt_ref.zero_grad();
      auto [x, y] = batch_of(t, kBatch);
      auto loss = mse(model_ref->forward(x), y);
      loss.backward();
      double sq = 0;
      for (auto& p : model_ref->parameters()) sq += p.grad().pow(2).sum().item<double>();
      ref_norms.push_back(std::sqrt(sq));
      const double scale = 0.05 / (std::sqrt(sq) + 1e-6);
      if (scale < 1) {
        for (auto& p : model_ref->parameters()) p.mutable_grad().mul_(scale);
      }
      opt_ref.step();
      ref_losses.push_back(loss.item<double>());
    }
    std::map<std::string, at::Tensor> ref;
    for (auto& p : model_ref->named_parameters()) ref[p.key()] = p.value().detach().clone();

    std::mutex mu;
    run_ranks(2 * dp, [&](comm::ProcessGroup& pg) {
      const auto groups = parallel::make_groups(pg, parallel::Layout{1, dp, 2});
      const int dp_rank = groups.data.rank();
      auto model = make_mlp(7);
      std::unique_ptr<pipeline::ShardedStages> sharded;
      auto stages = pipeline::split_sequential(model, 2);
      for (auto& st : stages) {
        st.forward = [&sharded, f = st.forward](const at::Tensor& x) {
          sharded->gather();
          return f(x);
        };
      }
      pipeline::Pipeline pipe(stages, groups.pipeline, mse, pipeline::PipelineOptions().schedule("1f1b").microbatches(2));
      sharded = std::make_unique<pipeline::ShardedStages>(pipe.stages(), groups);
      torch::optim::AdamW opt(sharded->trainable_shards(), torch::optim::AdamWOptions(1e-2));
      for (int t = 0; t < kSteps; ++t) {
        opt.zero_grad();
        ASSERT_EQ(sharded->state(), pipeline::ShardedStages::State::Sharded);
        for (auto& p : pipe.parameters()) ASSERT_EQ(p.numel(), 0) << "a parameter is held whole between steps";
        auto [x, y] = batch_of(t, kBatch);
        const int64_t per = kBatch / dp;
        double loss = pipe.step(x.narrow(0, dp_rank * per, per), y.narrow(0, dp_rank * per, per));
        sharded->reduce_gradients();
        const double norm = optim::clip_grad_norm(groups.world, sharded->trainable_shards(), 0.05);
        opt.step();
        sharded->reshard();
        auto l = at::tensor({loss}, at::kDouble);
        comm::all_reduce(groups.data, l, comm::AllReduceOptions().op(comm::ReduceOp::Avg));
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_NEAR(l.item<double>(), ref_losses[t], 1e-6) << "rank " << pg.rank() << " step " << t;
        EXPECT_NEAR(norm, ref_norms[t], 1e-5 * ref_norms[t]) << "rank " << pg.rank() << " step " << t;
      }
      sharded->gather();
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [name, p] : pipe.named_parameters())
        EXPECT_LT((p - ref.at(name)).abs().max().item<double>(), 1e-5) << name << " on rank " << pg.rank();
    });
  }
}

// A rank slowed at random points (before any forward or backward) never makes a step hang, with
// every schedule (Design note [pipeline transfers]); the results stay exact.
TEST(PipelineRuntime, RandomlySlowedRanksNeverHang) {
  std::vector<double> ref_losses;
  const auto ref = reference_mlp(&ref_losses);
  for (const Case& c : {Case{"1f1b", 4, 1, 3}, Case{"gpipe", 3, 1, 6}, Case{"interleaved", 3, 2, 3}}) {
    std::mutex mu;
    run_ranks(c.pp, [&](comm::ProcessGroup& pg) {
      auto model = make_mlp(7);
      auto stages = pipeline::split_sequential(model, c.pp * c.v);
      std::mt19937 rng(1234 + pg.rank());
      for (auto& s : stages) {
        s.forward = [inner = s.forward, &rng](const at::Tensor& x) {
          std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
          return inner(x);
        };
      }
      pipeline::Pipeline pipe(stages, pg, mse,
                              pipeline::PipelineOptions().schedule(c.schedule).microbatches(c.m).virtual_stages(c.v));
      torch::optim::AdamW opt(pipe.parameters(), torch::optim::AdamWOptions(1e-2));
      for (int t = 0; t < kSteps; ++t) {
        opt.zero_grad();
        auto [x, y] = batch_of(t, kBatch);
        pipe.step(x, y);
        opt.step();
      }
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [name, p] : pipe.named_parameters())
        EXPECT_LT((p - ref.at(name)).abs().max().item<double>(), 1e-5) << c.schedule << " " << name;
    }, 60000);
  }
}

// Design note [pipeline transfers]: a stage that leaves a step (its forward throws a CommError, as
// an aborted tensor-parallel collective does; or it never runs the step, as a stage that left
// through a collective outside the pipeline, FSDP's reduce-scatter) and then raises every rank's
// abort signal, as the elastic watchers do, ends its peers' steps: their receives from it (and the
// closing all-reduce) are interrupted by the signal, not waited for until the 20-s timeout. At the
// first step (no shape agreed: waiting for the shape message) and at the third, 1F1B and GPipe.
TEST(PipelineRuntime, AStageThatLeavesItsStepEndsItsPeersSteps) {
  for (const std::string schedule : {"1f1b", "gpipe"}) {
    for (const bool throws : {true, false}) {
      for (int fail_step : {0, 2}) {
        SCOPED_TRACE(schedule + (throws ? ", throwing" : ", leaving") + " at step " + std::to_string(fail_step + 1));
        std::vector<std::shared_ptr<comm::AbortSignal>> signals(3);
        std::vector<std::string> errors(3);
        const auto t0 = std::chrono::steady_clock::now();
        run_ranks(3, [&](comm::ProcessGroup& pg) {
          signals[static_cast<size_t>(pg.rank())] = pg.abort_signal();
          pg.abort_signal()->arm();
          auto stages = pipeline::split_sequential(make_mlp(7), 3);
          int step = 0;
          stages[1].forward = [inner = stages[1].forward, &step, fail_step, throws](const at::Tensor& x) {
            if (throws && step == fail_step) throw comm::CommError("the test's tensor-parallel collective was aborted");
            return inner(x);
          };
          pipeline::Pipeline pipe(stages, pg, mse, pipeline::PipelineOptions().schedule(schedule).microbatches(3));
          comm::barrier(pg);  // (every signal known)
          for (; step <= fail_step; ++step) {
            auto [x, y] = batch_of(step, 6);
            try {
              if (pg.rank() == 1 && !throws && step == fail_step) {
                std::this_thread::sleep_for(std::chrono::milliseconds(300));  // (the others wait for it first)
                throw comm::CommError("the test's reduce-scatter outside the pipeline was aborted");
              }
              pipe.step(x, y);
            } catch (const std::exception& e) {
              errors[static_cast<size_t>(pg.rank())] = e.what();
              if (pg.rank() == 1) {
                for (auto& s : signals) s->abort("the test's rank 1 failed");
              }
            }
          }
        }, 20000);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_LT(seconds, 10.0) << "a rank waited for a transfer that never came";
        EXPECT_NE(errors[1].find("the test's"), std::string::npos) << errors[1];
        for (int r : {0, 2}) EXPECT_NE(errors[static_cast<size_t>(r)].find("aborted"), std::string::npos) << "rank " << r << ": " << errors[static_cast<size_t>(r)];
      }
    }
  }
}

// The runtime's executed computations, per rank, at p = 2, 3, 4 for every schedule, against the
// schedules' definitions written out here independently of schedule.cpp (GPipe: all forwards, then
// all backwards, each in micro-batch order; 1F1B: min(p - 1 - r, m) forwards, then one forward and
// one backward in turn, then the remaining backwards in micro-batch order) and, for the interleaved
// schedule, against its table plus what any schedule must keep: each stage's forwards and
// backwards in micro-batch order. Fails if a schedule's cool-down runs backwards in reverse, or
// the runtime runs its actions out of the table's order.
TEST(PipelineRuntime, ExecutesTheScheduleTable) {
  using pipeline::Action;
  auto expected = [](const std::string& name, int p, int r, int m) {
    std::vector<Action> out;
    if (name == "gpipe") {
      for (int mb = 0; mb < m; ++mb) out.push_back({Kind::kForward, r, mb});
      for (int mb = 0; mb < m; ++mb) out.push_back({Kind::kBackward, r, mb});
    } else {  // 1f1b
      const int warmup = std::min(p - 1 - r, m);
      int f = 0, b = 0;
      while (f < warmup) out.push_back({Kind::kForward, r, f++});
      while (f < m) {
        out.push_back({Kind::kForward, r, f++});
        out.push_back({Kind::kBackward, r, b++});
      }
      while (b < m) out.push_back({Kind::kBackward, r, b++});
    }
    return out;
  };
  auto text = [](const std::vector<Action>& actions) {
    std::string s;
    for (const auto& a : actions) {
      s += std::string(a.kind == Kind::kForward ? " F" : " B") + std::to_string(a.microbatch) + "." + std::to_string(a.stage);
    }
    return s;
  };
  for (const std::string name : {"gpipe", "1f1b", "interleaved"}) {
    for (int p = 2; p <= 4; ++p) {
      const int v = name == "interleaved" ? 2 : 1, m = name == "interleaved" ? 2 * p : 5;
      std::mutex mu;
      run_ranks(p, [&](comm::ProcessGroup& pg) {
        torch::nn::Sequential model;
        {
          std::lock_guard<std::mutex> lock(mu);
          torch::manual_seed(3);
          for (int i = 0; i < p * v; ++i) model->push_back(torch::nn::Linear(4, 4));
        }
        pipeline::Pipeline pipe(pipeline::split_sequential(model, p * v), pg, mse,
                                pipeline::PipelineOptions().schedule(name).microbatches(m).virtual_stages(v));
        pipe.step(at::ones({2 * m, 4}), at::zeros({2 * m, 4}));
        const auto& ran = pipe.last_step_actions();
        const int r = pg.rank();
        std::lock_guard<std::mutex> lock(mu);
        const std::string where = name + " p=" + std::to_string(p) + " rank " + std::to_string(r);
        if (name == "interleaved") {
          EXPECT_EQ(text(ran), text(pipe.schedule().per_rank[static_cast<size_t>(r)])) << where;
        } else {
          EXPECT_EQ(text(ran), text(expected(name, p, r, m))) << where;
        }
        std::map<std::pair<int, int>, int> next;  // (kind, stage) -> the micro-batch due next
        for (const auto& a : ran) {
          int& due = next[{static_cast<int>(a.kind), a.stage}];
          EXPECT_EQ(a.microbatch, due) << where << ": out of micro-batch order in" << text(ran);
          due = a.microbatch + 1;
        }
        EXPECT_EQ(static_cast<int>(ran.size()), 2 * m * v) << where;
      }, 60000);
    }
  }
}

// ---- bad input ----

TEST(PipelineErrors, BadLayoutsAreClearErrors) {
  auto model = make_mlp(1);
  try {
    pipeline::split_sequential(model, 8);
    ADD_FAILURE() << "8 stages of 7 modules";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("more stages than modules of the Sequential"), std::string::npos) << e.what();
  }
  try {
    models::gpt_stages(make_gpt(2), 3);
    ADD_FAILURE() << "3 stages of 2 layers";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot cut 2 GPT layers into 3 pipeline stages"), std::string::npos)
        << e.what();
  }
  try {
    parallel::Layout{1, 1, 3}.validate(4);
    ADD_FAILURE() << "pipeline 3 on 4 ranks";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline 3 x replicate 1 x shard 1 does not fit 4 ranks"), std::string::npos)
        << e.what();
  }
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    auto m = make_mlp(1);
    try {
      pipeline::Pipeline pipe(pipeline::split_sequential(m, 3), pg, mse);
      ADD_FAILURE() << "3 stages on 2 ranks";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("cut into 3 stages, but 2 pipeline rank(s) x 1 virtual stage(s) need 2"),
                std::string::npos)
          << e.what();
    }
    pipeline::Pipeline pipe(pipeline::split_sequential(m, 2), pg, mse, pipeline::PipelineOptions().microbatches(5));
    auto [x, y] = batch_of(0, kBatch);
    try {
      pipe.step(x, y);
      ADD_FAILURE() << "5 micro-batches of 12";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("--microbatches 5 must divide the batch of 12 samples"), std::string::npos)
          << e.what();
    }
  });
}

// A stage whose output changes shape after the first step: the sender names both ranks and stages.
TEST(PipelineErrors, AShapeThatChangesNamesBothRanks) {
  std::mutex mu;
  std::vector<std::string> errors;
  try {
    run_ranks(2, [&](comm::ProcessGroup& pg) {
      auto m = make_mlp(1);
      auto stages = pipeline::split_sequential(m, 2);
      int calls = 0;
      stages[0].forward = [inner = stages[0].forward, &calls](const at::Tensor& x) {
        auto y = inner(x);
        return ++calls > 2 ? y.narrow(1, 0, 8) : y;  // step 2's first micro-batch is narrower
      };
      stages[1].forward = [inner = stages[1].forward](const at::Tensor& x) {
        return x.size(1) == 16 ? inner(x) : x;
      };
      pipeline::Pipeline pipe(stages, pg, mse, pipeline::PipelineOptions().microbatches(2));
      for (int t = 0; t < 2; ++t) {
        auto [x, y] = batch_of(t, 4);
        try {
          pipe.step(x, y);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          errors.push_back(e.what());
          throw;
        }
      }
    }, 3000);
  } catch (const std::exception&) {
  }
  bool named = false;
  for (auto& e : errors) named |= e.find("stage 0 on rank 0 produced [2, 8] Float for micro-batch 0, but stage 1 on "
                                         "rank 1 receives [2, 16] Float") != std::string::npos;
  EXPECT_TRUE(named) << (errors.empty() ? "no error" : errors.front());
}

}  // namespace
