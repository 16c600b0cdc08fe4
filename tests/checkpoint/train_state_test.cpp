// Training state <-> checkpoints (dtrain/checkpoint/train_state.h): the model and the optimizer
// (plain and ZeRO-sharded) saved at one world size resume at another and train on exactly like the
// run that never stopped; the random state per rank; small values; errors that name the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "dtrain/optim/state_dict.h"
#include "testing/models.h"
#include "testing/testing.h"

using namespace dtrain;
namespace ck = dtrain::checkpoint;
using dtrain::testing::Mlp;
using dtrain::testing::run_ranks;
using dtrain::testing::temp_dir;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_ERROR_HAS(stmt, text)                          \
  do {                                                        \
    const std::string msg_ = error_of([&] { stmt; });         \
    EXPECT_NE(msg_.find(text), std::string::npos) << msg_;    \
  } while (0)

// The same batch on every rank: full gradients are equal everywhere, as after DDP's all-reduce.
std::pair<at::Tensor, at::Tensor> batch(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(77 + step);
  return {at::randn({4, 6}, gen), at::randn({4, 3}, gen)};
}

using Groups = std::vector<torch::optim::OptimizerParamGroup>;

// Two param groups: the hidden layers with the optimizer's defaults, the output layer with options
// of its own (so group options must survive the checkpoint by group index).
Groups two_groups(Mlp& m, bool adamw) {
  std::vector<at::Tensor> body = m->a->parameters();
  for (const auto& p : m->b->parameters()) body.push_back(p);
  std::unique_ptr<torch::optim::OptimizerOptions> head;
  if (adamw) {
    head = std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(5e-3).weight_decay(0.1));
  } else {
    head = std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.02).momentum(0.5).nesterov(true));
  }
  Groups g;
  g.emplace_back(std::move(body));
  g.emplace_back(m->c->parameters(), std::move(head));
  return g;
}

std::unique_ptr<torch::optim::Optimizer> optimizer_over(Groups g, bool adamw) {
  if (!adamw) return std::make_unique<torch::optim::SGD>(std::move(g), torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(std::move(g), torch::optim::AdamWOptions(1e-2));
}

optim::ShardedOptimizer sharded_over(Mlp& m, comm::ProcessGroup& pg, bool adamw) {
  return optim::ShardedOptimizer(two_groups(m, adamw), pg, [adamw](Groups g) { return optimizer_over(std::move(g), adamw); });
}

// Group 0's learning rate is halved after step 2: the checkpoint must carry group options.
void maybe_halve_lr(int step, torch::optim::OptimizerOptions& o) {
  if (step == 2) o.set_lr(o.get_lr() / 2);
}

// Steps [from, to) of the reference schedule with any optimizer (`step_fn` after backward).
void train(Mlp& m, int from, int to, const std::function<void()>& zero_grad, const std::function<void()>& step_fn,
           const std::function<torch::optim::OptimizerOptions&()>& group0) {
  for (int t = from; t < to; ++t) {
    maybe_halve_lr(t, group0());
    zero_grad();
    auto [x, y] = batch(t);
    at::mse_loss(m->forward(x), y).backward();
    step_fn();
  }
}

void train_plain(Mlp& m, torch::optim::Optimizer& opt, int from, int to) {
  train(m, from, to, [&] { opt.zero_grad(); }, [&] { opt.step(); },
        [&]() -> torch::optim::OptimizerOptions& { return opt.param_groups()[0].options(); });
}

void train_sharded(Mlp& m, optim::ShardedOptimizer& opt, int from, int to) {
  train(m, from, to, [&] { opt.zero_grad(); }, [&] { opt.step(); },
        [&]() -> torch::optim::OptimizerOptions& { return opt.group_options(0); });
}

constexpr int kSaveAt = 3, kSteps = 6;

void expect_same_params(Mlp& a, Mlp& b, double tol) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LE(dtrain::testing::max_rel_diff(pa[i].value(), pb[i].value()), tol) << pa[i].key();
  }
}

// A reader per rank thread (Reader is thread-compatible, not thread-safe).
ck::Reader open(const std::string& dir) { return ck::Reader::open(dir); }

// A fresh model (other initial weights: everything must come from the checkpoint) and ZeRO-1
// optimizer over pg, loaded from `dir` (saved after kSaveAt steps), trained to kSteps: equal to `ref`.
void finish_sharded(comm::ProcessGroup& pg, const std::string& dir, bool adamw, Mlp& ref) {
  Mlp m = dtrain::testing::make_mlp(11);
  optim::ShardedOptimizer opt = sharded_over(m, pg, adamw);
  const ck::Reader reader = open(dir);
  ck::load_model(reader, *m);
  ck::load_optimizer(reader, opt, ck::param_names(*m, opt.params()));
  train_sharded(m, opt, kSaveAt, kSteps);
  expect_same_params(m, ref, 1e-6);
}

// A fresh model and plain optimizer loaded from `dir`.
struct Plain {
  Mlp m;
  std::unique_ptr<torch::optim::Optimizer> opt;
};
Plain plain_from(const std::string& dir, bool adamw) {
  Plain p{dtrain::testing::make_mlp(12), nullptr};
  p.opt = optimizer_over(two_groups(p.m, adamw), adamw);
  const ck::Reader reader = open(dir);
  ck::load_model(reader, *p.m);
  ck::load_optimizer(reader, *p.opt, ck::param_names(*p.m, p.m->parameters()), p.m->parameters());
  return p;
}

}  // namespace

TEST(TrainState, ModelSavedAtTwoRanksLoadsAtThree) {
  const std::string dir = temp_dir();
  dtrain::testing::Net saved = dtrain::testing::make_net(1, /*with_side=*/true);
  saved->steps.fill_(7);
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    ck::save(dir, 5, pg, ck::snapshot_model(*saved, pg.rank(), pg.size()).pieces, {});
  });
  const ck::Reader reader = open(dir);
  EXPECT_EQ(reader.step(), 5);
  EXPECT_TRUE(reader.has("model/fc1.weight"));
  EXPECT_TRUE(reader.has("model/frozen"));
  EXPECT_TRUE(reader.has("model/steps"));  // buffers too
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    dtrain::testing::Net fresh = dtrain::testing::make_net(2, /*with_side=*/true);
    ck::load_model(open(dir), *fresh);
    auto a = saved->named_parameters(), b = fresh->named_parameters();
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].value(), b[i].value())) << a[i].key();
    EXPECT_TRUE(at::equal(fresh->steps, saved->steps));
    EXPECT_TRUE(fresh->fc1->weight.requires_grad());
  });
}

class TrainStateResume : public ::testing::TestWithParam<bool> {};  // AdamW or SGD with momentum

// ZeRO-1 at W=3 -> ZeRO-1 at W=2, and -> a plain optimizer in one process; a plain optimizer's
// checkpoint (its state split among 2 ranks) -> ZeRO-1 at W=3. Each continues like the run that
// never stopped (group options included: group 0's learning rate was halved before the save).
TEST_P(TrainStateResume, OptimizerStateAcrossWorldSizesAndStrategies) {
  const bool adamw = GetParam();
  Mlp ref = dtrain::testing::make_mlp(3);
  auto ref_opt = optimizer_over(two_groups(ref, adamw), adamw);
  train_plain(ref, *ref_opt, 0, kSteps);

  // Saved by ZeRO-1 at W=3.
  const std::string zero_dir = temp_dir();
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    Mlp m = dtrain::testing::make_mlp(3);
    optim::ShardedOptimizer opt = sharded_over(m, pg, adamw);
    train_sharded(m, opt, 0, kSaveAt);
    auto snap = ck::snapshot_model(*m, pg.rank(), pg.size());
    snap.add(ck::snapshot_optimizer(opt, ck::param_names(*m, opt.params())));
    ck::save(zero_dir, kSaveAt, pg, snap.pieces, snap.metadata);
  });
  {
    const ck::Reader reader = open(zero_dir);
    EXPECT_EQ(reader.metadata().at("optim/kind"), adamw ? "AdamW" : "SGD");
    EXPECT_EQ(reader.metadata().at("optim/groups"), "2");
    EXPECT_TRUE(reader.has(adamw ? "optim/a.weight/exp_avg_sq" : "optim/a.weight/momentum_buffer"));
  }

  // -> ZeRO-1 at W=2.
  run_ranks(2, [&](comm::ProcessGroup& pg) { finish_sharded(pg, zero_dir, adamw, ref); });

  // -> a plain optimizer in one process; and its checkpoint, split among 2 ranks, -> ZeRO-1 at W=3.
  const std::string plain_dir = temp_dir();
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Plain p = plain_from(zero_dir, adamw);
    if (pg.rank() == 0) {
      Plain solo = plain_from(zero_dir, adamw);
      train_plain(solo.m, *solo.opt, kSaveAt, kSteps);
      expect_same_params(solo.m, ref, 1e-6);
    }
    const auto params = p.m->parameters();
    auto snap = ck::snapshot_model(*p.m, pg.rank(), pg.size());
    snap.add(ck::snapshot_optimizer(*p.opt, ck::param_names(*p.m, params), params, pg.rank(), pg.size()));
    ck::save(plain_dir, kSaveAt, pg, snap.pieces, snap.metadata);
  });
  run_ranks(3, [&](comm::ProcessGroup& pg) { finish_sharded(pg, plain_dir, adamw, ref); });
}

INSTANTIATE_TEST_SUITE_P(Optimizers, TrainStateResume, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "AdamW" : "SGD"; });

TEST(TrainState, ShardedOwnersWriteOnlyTheirState) {
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    Mlp m = dtrain::testing::make_mlp(3);
    optim::ShardedOptimizer opt(m->parameters(), pg, [](auto g) {
      return std::make_unique<torch::optim::AdamW>(std::move(g), torch::optim::AdamWOptions(1e-2));
    });
    train_sharded(m, opt, 0, 1);
    const auto names = ck::param_names(*m, opt.params());
    const auto snap = ck::snapshot_optimizer(opt, names);
    for (const auto& p : snap.pieces) {
      const std::string name = p.key.substr(6, p.key.rfind('/') - 6);
      const size_t i = std::find(names.begin(), names.end(), name) - names.begin();
      ASSERT_LT(i, names.size()) << p.key;
      EXPECT_EQ(opt.partition().owner[i], pg.rank()) << p.key;
      EXPECT_EQ(p.begin, 0) << p.key;
    }
  });
}

TEST(TrainState, MismatchedCheckpointsAreErrorsNamingTheKey) {
  const std::string dir = temp_dir(), net_dir = temp_dir(), double_dir = temp_dir();
  torch::nn::Linear small(4, 8);
  auto opt = std::make_unique<torch::optim::AdamW>(small->parameters(), torch::optim::AdamWOptions(1e-2));
  small->forward(at::ones({2, 4})).sum().backward();
  opt->step();
  run_ranks(1, [&](comm::ProcessGroup& pg) {
    auto snap = ck::snapshot_model(*small, 0, 1);
    snap.add(ck::snapshot_optimizer(*opt, ck::param_names(*small, small->parameters()), small->parameters(), 0, 1));
    ck::save(dir, 1, pg, snap.pieces, snap.metadata);
    ck::save(net_dir, 1, pg, ck::snapshot_model(*dtrain::testing::make_net(1, true), 0, 1).pieces, {});
    torch::nn::Linear d(4, 8);
    d->to(at::kDouble);
    ck::save(double_dir, 1, pg, ck::snapshot_model(*d, 0, 1).pieces, {});
  });
  const ck::Reader reader = open(dir);

  torch::nn::Linear wide(4, 9);
  const auto before = wide->weight.clone();
  EXPECT_ERROR_HAS(ck::load_model(reader, *wide), "model/weight has shape [8, 4] in the checkpoint but the model's "
                                                  "weight has shape [9, 4]");
  EXPECT_TRUE(at::equal(before, wide->weight));  // nothing changed
  EXPECT_ERROR_HAS(ck::load_model(open(double_dir), *small), "model/weight is Double in the checkpoint");

  // A missing and an extra parameter.
  EXPECT_ERROR_HAS(ck::load_model(open(net_dir), *dtrain::testing::make_net(1, false)),
                   "model/side.bias is in the checkpoint but the model has no side.bias");
  EXPECT_ERROR_HAS(ck::load_model(reader, *dtrain::testing::make_net(1, false)), "no key model/frozen in the checkpoint");

  // Optimizer: another type, another model's names, another shape.
  torch::optim::SGD sgd(small->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_ERROR_HAS(ck::load_optimizer(reader, sgd, {"weight", "bias"}, small->parameters()),
                   "optim/kind is AdamW in the checkpoint but the optimizer is SGD");
  torch::optim::AdamW adamw(small->parameters(), torch::optim::AdamWOptions(1e-2));
  EXPECT_ERROR_HAS(ck::load_optimizer(reader, adamw, {"w", "bias"}, small->parameters()),
                   "optim/weight/");
  torch::optim::AdamW wide_opt(wide->parameters(), torch::optim::AdamWOptions(1e-2));
  EXPECT_ERROR_HAS(ck::load_optimizer(reader, wide_opt, {"weight", "bias"}, wide->parameters()),
                   "optim/weight/exp_avg has shape [8, 4] in the checkpoint but parameter weight has shape [9, 4]");
  // A checkpoint without optimizer state.
  EXPECT_ERROR_HAS(ck::load_optimizer(open(net_dir), adamw, {"weight", "bias"}, small->parameters()),
                   "no metadata key optim/kind");
}

// Each rank's generator state; at a larger world size the extra ranks take rank 0's.
TEST(TrainState, RandomStatePerRank) {
  const std::string dir = temp_dir();
  std::mutex mu;  // the CPU generator is one per process: each rank thread sets and reads it in turn
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    ck::Snapshot snap;
    {
      std::lock_guard<std::mutex> lock(mu);
      at::manual_seed(100 + pg.rank());
      snap = ck::snapshot_rng(pg.rank());
    }
    ck::save(dir, 1, pg, snap.pieces, snap.metadata);
  });
  auto draws = [](uint64_t seed) {
    at::manual_seed(seed);
    return at::rand({5});
  };
  const at::Tensor rank0 = draws(100), rank1 = draws(101);
  const ck::Reader reader = open(dir);
  at::manual_seed(7);
  ck::load_rng(reader, 1);
  EXPECT_TRUE(at::equal(at::rand({5}), rank1));
  ck::load_rng(reader, 0);
  EXPECT_TRUE(at::equal(at::rand({5}), rank0));
  ck::load_rng(reader, 2);  // saved at W=2: rank 2 takes rank 0's
  EXPECT_TRUE(at::equal(at::rand({5}), rank0));
}

TEST(TrainState, SmallValuesRoundTrip) {
  ck::Metadata meta;
  ck::put(meta, "a", int64_t{-42});
  ck::put(meta, "b", 0.1);
  ck::put(meta, "c", 1e-300);
  ck::put(meta, "s", std::string("zero2"));
  EXPECT_EQ(ck::get_int(meta, "a"), -42);
  EXPECT_EQ(ck::get_double(meta, "b"), 0.1);  // exactly
  EXPECT_EQ(ck::get_double(meta, "c"), 1e-300);
  EXPECT_EQ(ck::get_string(meta, "s"), "zero2");
  EXPECT_ERROR_HAS(ck::get_int(meta, "missing"), "no metadata key missing");
  EXPECT_ERROR_HAS(ck::get_int(meta, "s"), "metadata s must be an integer, got \"zero2\"");

  amp::GradScalerState scaler;
  scaler.scale = 1024.5;
  scaler.growth_tracker = 17;
  ck::put_grad_scaler_state(meta, scaler);
  const auto back = ck::grad_scaler_state(meta);
  EXPECT_EQ(back.scale, 1024.5);
  EXPECT_EQ(back.growth_tracker, 17);
  EXPECT_ERROR_HAS(ck::grad_scaler_state(ck::Metadata{}), "amp/scale");
  meta["amp/scale"] = "-1";
  EXPECT_ERROR_HAS(ck::grad_scaler_state(meta), "amp/scale must be > 0");

  ck::Snapshot x, y;
  ck::put(x.metadata, "k", int64_t{1});
  ck::put(y.metadata, "k", int64_t{2});
  EXPECT_ERROR_HAS(x.add(y), "metadata key k is set twice");
}
