// Optimizer state dicts: ZeRO-1's consolidated state against the plain optimizer's (SGD with
// momentum, Adam, AdamW, RMSprop, Adagrad; W = 1, 2, 3), loading it back at another world size or
// into a plain optimizer and training on, and the errors for dicts that do not fit.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <optional>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm.h"
#include "dtrain/ddp/distributed_data_parallel.h"
#include "dtrain/optim/sharded_optimizer.h"
#include "dtrain/optim/state_dict.h"
#include "testing/testing.h"

using namespace dtrain;
using dtrain::testing::run_ranks;
namespace to = torch::optim;

namespace {

enum class Kind { SGD, Adam, AdamW, RMSprop, Adagrad };
const Kind kKinds[] = {Kind::SGD, Kind::Adam, Kind::AdamW, Kind::RMSprop, Kind::Adagrad};

std::string name_of(Kind k) {
  switch (k) {
    case Kind::SGD: return "SGD";
    case Kind::Adam: return "Adam";
    case Kind::AdamW: return "AdamW";
    case Kind::RMSprop: return "RMSprop";
    case Kind::Adagrad: return "Adagrad";
  }
  return "?";
}

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(6, 40));
    b = register_module("b", torch::nn::Linear(40, 24));
    c = register_module("c", torch::nn::Linear(24, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return c(at::tanh(b(at::tanh(a(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Net);

Net make_net(at::ScalarType dtype = at::kFloat) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(5);
  Net net;
  net->to(dtype);
  return net;
}

// The global batch of step t: kRows rows, split evenly over the ranks (kRows divides by 1, 2, 3).
constexpr int64_t kRows = 12;
std::pair<at::Tensor, at::Tensor> batch(int t, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(91 + t);
  return {at::randn({kRows, 6}, gen).to(dtype), at::randn({kRows, 3}, gen).to(dtype)};
}
at::ScalarType dtype_of(Net& net) { return net->parameters()[0].scalar_type(); }

// Two param groups: the first layer with options of its own (that switch on the optional state
// fields where the other group does not, or the other way round), the rest on the defaults.
std::vector<to::OptimizerParamGroup> groups_of(Net& m, Kind k) {
  std::vector<at::Tensor> first = m->a->parameters(), rest;
  for (auto& p : m->b->parameters()) rest.push_back(p);
  for (auto& p : m->c->parameters()) rest.push_back(p);
  std::unique_ptr<to::OptimizerOptions> o;
  switch (k) {
    case Kind::SGD: o = std::make_unique<to::SGDOptions>(to::SGDOptions(0.02).momentum(0.9).nesterov(true)); break;
    case Kind::Adam: o = std::make_unique<to::AdamOptions>(to::AdamOptions(5e-3).amsgrad(true)); break;
    case Kind::AdamW: o = std::make_unique<to::AdamWOptions>(to::AdamWOptions(5e-3).weight_decay(0.1)); break;
    case Kind::RMSprop: o = std::make_unique<to::RMSpropOptions>(to::RMSpropOptions(5e-3)); break;
    case Kind::Adagrad: o = std::make_unique<to::AdagradOptions>(to::AdagradOptions(0.02)); break;
  }
  std::vector<to::OptimizerParamGroup> g;
  g.emplace_back(first, std::move(o));
  g.emplace_back(rest);
  return g;
}

std::unique_ptr<to::Optimizer> make_opt(std::vector<to::OptimizerParamGroup> g, Kind k) {
  switch (k) {
    case Kind::SGD:
      return std::make_unique<to::SGD>(std::move(g), to::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
    case Kind::Adam: return std::make_unique<to::Adam>(std::move(g), to::AdamOptions(1e-2));
    case Kind::AdamW: return std::make_unique<to::AdamW>(std::move(g), to::AdamWOptions(1e-2));
    case Kind::RMSprop:
      return std::make_unique<to::RMSprop>(std::move(g), to::RMSpropOptions(1e-2).momentum(0.5).centered(true));
    case Kind::Adagrad:
      return std::make_unique<to::Adagrad>(
          std::move(g), to::AdagradOptions(0.05).lr_decay(0.01).initial_accumulator_value(0.1));
  }
  return nullptr;
}

constexpr int kHalveAt = 3;  // every group's learning rate halves before this step

// Steps [from, to) of the plain optimizer on the whole global batch.
void train_plain(Net& net, to::Optimizer& opt, int from, int to) {
  for (int t = from; t < to; ++t) {
    if (t == kHalveAt) {
      for (auto& g : opt.param_groups()) g.options().set_lr(g.options().get_lr() / 2);
    }
    opt.zero_grad();
    auto [x, y] = batch(t, dtype_of(net));
    at::mse_loss(net->forward(x), y).backward();
    opt.step();
  }
}

// Steps [from, to) with DDP + ShardedOptimizer, this rank's rows of the global batch.
void train_sharded(ddp::DistributedDataParallel<Net>& model, Net& net, optim::ShardedOptimizer& opt,
                   const comm::ProcessGroup& pg, int from, int to) {
  const int64_t rows = kRows / pg.size();
  for (int t = from; t < to; ++t) {
    if (t == kHalveAt) {
      for (size_t g = 0; g < opt.num_groups(); ++g) {
        opt.group_options(g).set_lr(opt.group_options(g).get_lr() / 2);
      }
    }
    opt.zero_grad();
    auto [x, y] = batch(t, dtype_of(net));
    at::mse_loss(model->forward(x.narrow(0, pg.rank() * rows, rows)), y.narrow(0, pg.rank() * rows, rows)).backward();
    opt.step();
  }
}

std::vector<at::Tensor> snapshot(Net& net) {
  std::vector<at::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

void set_params(Net& net, const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  auto ps = net->parameters();
  for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(values[i]);
}

double rel(const at::Tensor& got, const at::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item<double>();
}

void expect_close_params(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want, double tol,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LT(rel(got[i], want[i]), tol) << what << ": param " << i;
}

void expect_same_state(const optim::OptimizerStateDict& got, const optim::OptimizerStateDict& want, double tol) {
  EXPECT_EQ(got.optimizer, want.optimizer);
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    ASSERT_EQ(got.params[i].has_value(), want.params[i].has_value()) << "param " << i;
    if (!want.params[i]) continue;
    const auto& g = got.params[i]->tensors;
    const auto& w = want.params[i]->tensors;
    std::vector<std::string> gk, wk;
    for (const auto& kv : g) gk.push_back(kv.first);
    for (const auto& kv : w) wk.push_back(kv.first);
    ASSERT_EQ(gk, wk) << "param " << i;
    for (const auto& [name, t] : w) {
      const auto& u = g.at(name);
      EXPECT_EQ(u.sizes(), t.sizes()) << "param " << i << " " << name;
      EXPECT_EQ(u.scalar_type(), t.scalar_type()) << "param " << i << " " << name;
      if (name == "step") {
        EXPECT_EQ(u.item<int64_t>(), t.item<int64_t>()) << "param " << i;
      } else if (tol == 0) {
        EXPECT_TRUE(u.equal(t)) << "param " << i << " " << name;
      } else {
        EXPECT_LT(rel(u, t), tol) << "param " << i << " " << name;
      }
    }
  }
  ASSERT_EQ(got.groups.size(), want.groups.size());
  for (size_t g = 0; g < got.groups.size(); ++g) {
    EXPECT_EQ(got.groups[g].params, want.groups[g].params) << "group " << g;
    EXPECT_EQ(got.groups[g].options, want.groups[g].options) << "group " << g;
  }
}

// Runs fn and expects a c10::Error whose message contains every one of `parts`.
template <class Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << parts.front();
  } catch (const c10::Error& e) {
    const std::string msg = e.msg();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "\"" << p << "\" not in: " << msg;
  }
}

constexpr int kSteps = 6, kMore = 4;

}  // namespace

// ---- consolidated state = the plain optimizer's ------------------------------------------------

class ConsolidatedState : public ::testing::TestWithParam<std::tuple<int, Kind>> {};

// In double precision, so that the only difference from the plain optimizer (DDP's gradient mean
// over ranks vs one batch's mean) stays far below the 1e-6 tolerance; the transfer itself is
// checked bit for bit against each owner's own state. (The float path: Resharding below.)
TEST_P(ConsolidatedState, EqualsThePlainOptimizers) {
  const auto [W, kind] = GetParam();
  Net ref = make_net(at::kDouble);
  auto plain = make_opt(groups_of(ref, kind), kind);
  train_plain(ref, *plain, 0, kSteps);
  const auto want = optim::state_dict_of(*plain, ref->parameters());
  ASSERT_EQ(want.optimizer, name_of(kind));
  for (const auto& p : want.params) ASSERT_TRUE(p.has_value());  // every parameter has state

  std::optional<optim::OptimizerStateDict> got;
  std::vector<std::optional<optim::OptimizerStateDict>> owned(W);  // per rank: its own state
  std::atomic<int64_t> bytes{0};
  run_ranks(W, [&, W = W, kind = kind](comm::ProcessGroup& pg) {
    Net net = make_net(at::kDouble);
    auto model = ddp::DistributedDataParallel<Net>(net, pg);
    optim::ShardedOptimizer opt(groups_of(net, kind), pg, [kind = kind](auto g) { return make_opt(std::move(g), kind); });
    train_sharded(model, net, opt, pg, 0, kSteps);
    std::vector<at::Tensor> mine;
    for (size_t i : opt.partition().by_rank[pg.rank()]) mine.push_back(opt.params()[i]);
    owned[pg.rank()] = optim::state_dict_of(opt.local(), mine);
    auto full = opt.consolidate_state_dict(0);
    EXPECT_EQ(full.has_value(), pg.rank() == 0) << "rank " << pg.rank();
    if (full) got = std::move(full);
    const int64_t local_bytes = optim::state_bytes(opt.local());
    bytes += local_bytes;
    if (W > 1) EXPECT_LT(local_bytes, optim::state_bytes(*plain)) << "rank " << pg.rank();
  });
  ASSERT_TRUE(got.has_value());
  expect_same_state(*got, want, 1e-6);
  // Every entry exactly as its owner holds it.
  const auto partition = optim::partition_greedy(ref->parameters(), W);
  for (int r = 0; r < W; ++r) {
    const auto& idx = partition.by_rank[r];
    for (size_t j = 0; j < idx.size(); ++j) {
      for (const auto& [name, t] : owned[r]->params[j]->tensors) {
        EXPECT_TRUE(got->params[idx[j]]->tensors.at(name).equal(t)) << "param " << idx[j] << " " << name;
      }
    }
  }
  // Optimizer memory: the ranks together hold exactly the plain optimizer's state.
  EXPECT_EQ(bytes.load(), optim::state_bytes(*plain));
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndOptimizers, ConsolidatedState,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::ValuesIn(kKinds)),
                         [](const auto& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" + name_of(std::get<1>(info.param));
                         });

// ---- resharding: consolidate at W=3, continue at W=2 and in one process ---------------------

class Resharding : public ::testing::TestWithParam<Kind> {};

TEST_P(Resharding, ContinuesAsTheUninterruptedRun) {
  const Kind kind = GetParam();
  // Uninterrupted plain run: kSteps, (state and parameters kept), then kMore.
  Net ref = make_net();
  auto plain = make_opt(groups_of(ref, kind), kind);
  train_plain(ref, *plain, 0, kSteps);
  const auto plain_dict = optim::state_dict_of(*plain, ref->parameters());
  const auto plain_params = snapshot(ref);
  const double lr0 = plain->param_groups()[0].options().get_lr();
  train_plain(ref, *plain, kSteps, kSteps + kMore);
  const auto want = snapshot(ref);

  // kSteps at W=3, consolidated on rank 2.
  std::optional<optim::OptimizerStateDict> dict;
  std::vector<at::Tensor> params_at_3;
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    Net net = make_net();
    auto model = ddp::DistributedDataParallel<Net>(net, pg);
    optim::ShardedOptimizer opt(groups_of(net, kind), pg, [&](auto g) { return make_opt(std::move(g), kind); });
    train_sharded(model, net, opt, pg, 0, kSteps);
    auto full = opt.consolidate_state_dict(2);
    if (pg.rank() == 2) {
      dict = std::move(full);
      params_at_3 = snapshot(net);
    }
  });
  ASSERT_TRUE(dict.has_value());
  expect_same_state(*dict, plain_dict, 1e-5);  // float: DDP's mean differs from one batch's in rounding

  // Loaded into a fresh ShardedOptimizer at W=2 (built with the initial learning rates: the dict
  // brings the halved ones).
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Net net = make_net();
    set_params(net, params_at_3);
    auto model = ddp::DistributedDataParallel<Net>(net, pg);
    optim::ShardedOptimizer opt(groups_of(net, kind), pg, [&](auto g) { return make_opt(std::move(g), kind); });
    opt.load_state_dict(*dict);
    EXPECT_EQ(opt.group_options(0).get_lr(), lr0);
    int64_t with_state = 0;
    for (const auto& kv : opt.local().state()) (void)kv, ++with_state;
    EXPECT_EQ(with_state, static_cast<int64_t>(opt.partition().by_rank[pg.rank()].size()));
    train_sharded(model, net, opt, pg, kSteps, kSteps + kMore);
    expect_close_params(snapshot(net), want, 1e-5, "W=3 -> W=2, rank " + std::to_string(pg.rank()));
  });

  // Into a plain optimizer in one process.
  {
    Net net = make_net();
    set_params(net, params_at_3);
    auto opt = make_opt(groups_of(net, kind), kind);
    optim::load_state_dict_into(*opt, net->parameters(), *dict);
    EXPECT_EQ(opt->param_groups()[0].options().get_lr(), lr0);
    train_plain(net, *opt, kSteps, kSteps + kMore);
    expect_close_params(snapshot(net), want, 1e-5, "W=3 -> plain");
  }

  // And the plain optimizer's own dict into ZeRO-1 at W=3.
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    Net net = make_net();
    set_params(net, plain_params);
    auto model = ddp::DistributedDataParallel<Net>(net, pg);
    optim::ShardedOptimizer opt(groups_of(net, kind), pg, [&](auto g) { return make_opt(std::move(g), kind); });
    opt.load_state_dict(plain_dict);
    train_sharded(model, net, opt, pg, kSteps, kSteps + kMore);
    expect_close_params(snapshot(net), want, 1e-5, "plain -> W=3, rank " + std::to_string(pg.rank()));
  });
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Resharding, ::testing::ValuesIn(kKinds),
                         [](const auto& info) { return name_of(info.param); });

// ---- the plain functions ---------------------------------------------------------------------

TEST(StateDict, RoundTripsThroughAPlainOptimizer) {
  Net net = make_net();
  auto opt = make_opt(groups_of(net, Kind::Adam), Kind::Adam);
  train_plain(net, *opt, 0, 2);
  auto d = optim::state_dict_of(*opt, net->parameters());
  // The optional field is there only where amsgrad is on (group 0: parameters 0 and 1).
  EXPECT_EQ(d.params[0]->tensors.count("max_exp_avg_sq"), 1u);
  EXPECT_EQ(d.params[2]->tensors.count("max_exp_avg_sq"), 0u);
  EXPECT_EQ(d.params[3]->tensors.at("step").item<int64_t>(), 2);
  EXPECT_EQ(d.groups[0].params, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(d.groups[1].params, (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(d.groups[0].options.at("amsgrad"), 1.0);
  EXPECT_EQ(d.groups[1].options.at("lr"), 1e-2);
  // The dict is a copy: training on does not change it, and loading copies again.
  const auto before = d.params[2]->tensors.at("exp_avg").clone();
  train_plain(net, *opt, 2, 3);
  EXPECT_TRUE(d.params[2]->tensors.at("exp_avg").equal(before));
  Net other = make_net();
  auto opt2 = make_opt(groups_of(other, Kind::Adam), Kind::Adam);
  optim::load_state_dict_into(*opt2, other->parameters(), d);
  expect_same_state(optim::state_dict_of(*opt2, other->parameters()), d, 0);
  EXPECT_EQ(optim::state_bytes(*opt2), optim::state_bytes(*opt));
  // No state for a parameter: it ends with none.
  d.params[5].reset();
  optim::load_state_dict_into(*opt2, other->parameters(), d);
  EXPECT_FALSE(optim::state_dict_of(*opt2, other->parameters()).params[5].has_value());
  EXPECT_TRUE(optim::state_dict_of(*opt2, other->parameters()).params[4].has_value());
}

// state_dict_view (Design note [snapshots are views]): the same fields and options as
// state_dict_of, but the optimizer's own tensors, no copies.
TEST(StateDict, ViewIsTheLiveState) {
  Net net = make_net();
  auto opt = make_opt(groups_of(net, Kind::Adam), Kind::Adam);
  train_plain(net, *opt, 0, 2);
  const auto copy = optim::state_dict_of(*opt, net->parameters());
  const auto view = optim::state_dict_view(*opt, net->parameters());
  expect_same_state(view, copy, 0);
  for (size_t i = 0; i < view.params.size(); ++i) {
    for (const auto& [field, t] : view.params[i]->tensors) {
      if (field == "step") continue;
      EXPECT_EQ(t.data_ptr(), optim::state_dict_view(*opt, net->parameters()).params[i]->tensors.at(field).data_ptr());
    }
  }
  const auto before = view.params[2]->tensors.at("exp_avg").clone();
  train_plain(net, *opt, 2, 3);
  EXPECT_FALSE(view.params[2]->tensors.at("exp_avg").equal(before));  // it moved with the optimizer
}

TEST(StateDict, SgdWithoutMomentumHasNoState) {
  Net net = make_net();
  to::SGD opt(net->parameters(), to::SGDOptions(0.1));
  train_plain(net, opt, 0, 1);
  auto d = optim::state_dict_of(opt, net->parameters());
  for (const auto& p : d.params) EXPECT_FALSE(p.has_value());
  EXPECT_EQ(optim::state_bytes(opt), 0);
}

class StateDictErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    opt = make_opt(groups_of(net, Kind::Adam), Kind::Adam);
    train_plain(net, *opt, 0, 1);
    good = optim::state_dict_of(*opt, net->parameters());
  }
  // Loading `d` fails with a message holding `parts`, and leaves the optimizer as it was.
  void expect_rejected(const optim::OptimizerStateDict& d, const std::vector<std::string>& parts) {
    expect_error([&] { optim::load_state_dict_into(*opt, net->parameters(), d); }, parts);
    expect_same_state(optim::state_dict_of(*opt, net->parameters()), good, 0);
  }
  Net net = make_net();
  std::unique_ptr<to::Optimizer> opt;
  optim::OptimizerStateDict good;
};

TEST_F(StateDictErrors, WrongShape) {
  auto d = good;
  d.params[2]->tensors["exp_avg"] = at::zeros({3, 3});
  expect_rejected(d, {"load_state_dict_into", "parameter 2", "\"exp_avg\"", "shape [3, 3]", "[24, 40]"});
}

TEST_F(StateDictErrors, WrongDtype) {
  auto d = good;
  d.params[4]->tensors["exp_avg_sq"] = d.params[4]->tensors["exp_avg_sq"].to(at::kDouble);
  expect_rejected(d, {"parameter 4", "\"exp_avg_sq\"", "Double", ".to(Float)"});
}

TEST_F(StateDictErrors, UnknownKey) {
  auto d = good;
  d.params[1]->tensors["momentum_buffer"] = at::zeros({40});
  expect_rejected(d, {"parameter 1", "unknown field \"momentum_buffer\"", "Adam", "exp_avg_sq"});
  auto e = good;
  e.groups[1].options["momentum"] = 0.9;
  expect_rejected(e, {"param group 1", "unknown option \"momentum\""});
}

TEST_F(StateDictErrors, MissingField) {
  auto d = good;
  d.params[3]->tensors.erase("exp_avg_sq");
  expect_rejected(d, {"parameter 3", "no field \"exp_avg_sq\""});
  auto e = good;  // amsgrad is on in group 0
  e.params[0]->tensors.erase("max_exp_avg_sq");
  expect_rejected(e, {"parameter 0", "\"max_exp_avg_sq\""});
}

TEST_F(StateDictErrors, OtherOptimizerOrModel) {
  Net other = make_net();
  to::SGD sgd(other->parameters(), to::SGDOptions(0.1).momentum(0.9));
  expect_error([&] { optim::load_state_dict_into(sgd, other->parameters(), good); },
               {"for Adam", "is SGD"});
  auto fewer = net->parameters();
  fewer.pop_back();
  expect_error([&] { optim::load_state_dict_into(*opt, fewer, good); }, {"6 parameter entries", "5 parameters"});
  expect_error([&] { optim::state_dict_of(*opt, fewer); }, {"not in params_in_order"});
  auto d = good;
  d.params[2]->tensors["step"] = at::scalar_tensor(-1, at::kLong);
  expect_rejected(d, {"parameter 2", "\"step\"", "whole number"});
  auto e = good;
  e.groups[0].params = {0};  // parameter 1 moved to the other group
  e.groups[1].params = {1, 2, 3, 4, 5};
  expect_rejected(e, {"param group 0", "holds parameters [0, 1] here but [0]"});
  auto f = good;
  f.groups[1].params.push_back(0);
  expect_rejected(f, {"parameter 0 is in param groups 0 and 1"});
}

TEST(StateDict, UnsupportedOptimizer) {
  Net net = make_net();
  to::LBFGS lbfgs(net->parameters(), to::LBFGSOptions(0.1));
  const std::vector<std::string> parts{"unsupported optimizer type", "LBFGS", "SGD, Adam, AdamW, RMSprop and Adagrad"};
  expect_error([&] { optim::state_dict_of(lbfgs, net->parameters()); }, parts);
  expect_error([&] { optim::state_bytes(lbfgs); }, parts);
  expect_error([&] { optim::load_state_dict_into(lbfgs, net->parameters(), optim::OptimizerStateDict{}); }, parts);
  // Sharded: every rank fails alike, naming itself, before any communication.
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Net mine = make_net();
    optim::ShardedOptimizer opt(mine->parameters(), pg, [](std::vector<to::OptimizerParamGroup> g) {
      return std::make_unique<to::LBFGS>(std::move(g), to::LBFGSOptions(0.1));
    });
    expect_error([&] { opt.consolidate_state_dict(0); },
                 {"[dtrain rank " + std::to_string(pg.rank()), "consolidate_state_dict", "LBFGS"});
  });
}

TEST(ShardedStateDict, BadDictFailsOnEveryRank) {
  Net ref = make_net();
  auto plain = make_opt(groups_of(ref, Kind::RMSprop), Kind::RMSprop);
  train_plain(ref, *plain, 0, 1);
  auto d = optim::state_dict_of(*plain, ref->parameters());
  d.params[5]->tensors["grad_avg"] = at::zeros({7});  // owned by one rank only
  run_ranks(2, [&](comm::ProcessGroup& pg) {
    Net net = make_net();
    optim::ShardedOptimizer opt(groups_of(net, Kind::RMSprop), pg,
                                [](auto g) { return make_opt(std::move(g), Kind::RMSprop); });
    expect_error([&] { opt.load_state_dict(d); },
                 {"[dtrain rank " + std::to_string(pg.rank()), "load_state_dict", "parameter 5", "\"grad_avg\""});
    expect_error([&] { opt.consolidate_state_dict(2); }, {"to_rank 2", "outside the group [0, 2)"});
  });
}
