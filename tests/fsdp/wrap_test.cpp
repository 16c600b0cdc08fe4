// FSDP units and what they hold: nested units picked by type, size or by hand (and the error for a
// module that cannot be a unit); tied parameters used in two units, frozen parameters next to
// trainable ones, buffers; sync_module_states; the 2-D layout's validation.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "dtrain/fsdp/unit_plan.h"
#include "fsdp_testing.h"

using namespace dtrain;
using namespace dtrain::fsdp_testing;
using dtrain::testing::run_ranks;
using fsdp::ShardingStrategy;

namespace {

using Names = std::set<std::string>;

Names linear_names(const std::string& prefix) { return {prefix + ".weight", prefix + ".bias"}; }
Names hook_linear_names(const std::string& prefix) {
  return {prefix + ".weight", prefix + ".bias", prefix + ".alpha"};
}
Names join(std::initializer_list<Names> parts) {
  Names out;
  for (const auto& p : parts) out.insert(p.begin(), p.end());
  return out;
}

struct PolicyCase {
  std::string name;
  std::function<fsdp::WrapPolicy(NestedNet&)> policy;
  std::map<std::string, Names> units;           // unit name -> parameters it holds
  std::map<std::string, std::string> parents;  // unit name -> enclosing unit's name
};

// NestedNet's sizes: HookLinear(16, 16) 288 parameters, group.pre 272, group in all 848.
std::vector<PolicyCase> policy_cases() {
  const Names root = join({linear_names("in"), linear_names("out")});
  const Names pre = linear_names("group.pre");
  const Names i1 = hook_linear_names("group.inner1"), i2 = hook_linear_names("group.inner2");
  return {
      {"by_size_250", [](NestedNet&) { return fsdp::WrapPolicy::by_size(250); },
       {{"", root}, {"group", pre}, {"group.inner1", i1}, {"group.inner2", i2}},
       {{"group", ""}, {"group.inner1", "group"}, {"group.inner2", "group"}}},
      {"by_size_300", [](NestedNet&) { return fsdp::WrapPolicy::by_size(300); },
       {{"", root}, {"group", join({pre, i1, i2})}},
       {{"group", ""}}},
      {"manual_group_inner1",
       [](NestedNet& n) { return fsdp::WrapPolicy::modules({n->group.ptr(), n->group->inner1.ptr()}); },
       {{"", root}, {"group", join({pre, i2})}, {"group.inner1", i1}},
       {{"group", ""}, {"group.inner1", "group"}}},
      {"manual_inner2_only", [](NestedNet& n) { return fsdp::WrapPolicy::modules({n->group->inner2.ptr()}); },
       {{"", join({root, pre, i1})}, {"group.inner2", i2}},
       {{"group.inner2", ""}}},
      {"by_type_hook_linear", [](NestedNet&) { return fsdp::WrapPolicy::by_type<HookLinearImpl>(); },
       {{"", join({root, pre})}, {"group.inner1", i1}, {"group.inner2", i2}},
       {{"group.inner1", ""}, {"group.inner2", ""}}},
  };
}

// The exception each rank's construction throws ("" when none). The barriers keep a rank that
// fails at once from closing its connections while a peer is still connecting or still failing
// (Gloo then reports "Connection closed by peer" on that peer instead of the error under test).
template <class Fn>
std::vector<std::string> errors_of(int world, Fn fn) {
  std::vector<std::string> errors(world);
  run_ranks(world, [&](comm::ProcessGroup& pg) {
    comm::barrier(pg);
    try {
      fn(pg);
    } catch (const std::exception& e) {
      errors[pg.rank()] = e.what();
    }
    comm::barrier(pg);
  });
  return errors;
}

}  // namespace

class FsdpWrapPolicy : public ::testing::TestWithParam<PolicyCase> {};

TEST_P(FsdpWrapPolicy, UnitsHoldTheirParametersAndTrainLikeOneProcess) {
  const PolicyCase& c = GetParam();
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.steps = 5;
  for (int W : {2, 3}) {
    const Reference ref = train_reference(make_nested(5), spec, W);
    run_ranks(W, [&](comm::ProcessGroup& pg) {
      NestedNet net = make_nested(5);
      auto model = fsdp::FullyShardedDataParallel<NestedNet>(net, pg,
                                                             fsdp::FullyShardedOptions().wrap_policy(c.policy(net)));
      const auto& state = model->state();
      ASSERT_EQ(state.units().size(), c.units.size()) << c.name << "\n" << state.describe();
      EXPECT_EQ(state.units()[0]->name, "") << "units()[0] is the root";
      EXPECT_EQ(state.units()[0]->parent, -1);
      for (const auto& [name, params] : c.units) {
        const int i = unit_index(state, name);
        ASSERT_GE(i, 0) << c.name << ": no unit '" << name << "'\n" << state.describe();
        EXPECT_EQ(unit_param_names(*state.units()[i]), params) << c.name << ": unit '" << name << "'";
        if (name.empty()) continue;
        const int parent = state.units()[i]->parent;
        ASSERT_GE(parent, 0) << c.name << ": unit '" << name << "' has no parent";
        EXPECT_EQ(state.units()[parent]->name, c.parents.at(name)) << c.name << ": parent of '" << name << "'";
      }
      auto opt = make_opt(spec, model->parameters());
      train(model, *opt, spec, pg.rank(), W);
      auto dict = model->full_state_dict(0);
      if (pg.rank() == 0) expect_dicts_close(dict, ref.values, 1e-5, c.name + " W" + std::to_string(W));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, FsdpWrapPolicy, ::testing::ValuesIn(policy_cases()),
                         [](const auto& info) { return info.param.name; });

namespace {

// The parameter names of each unit of a plan, by unit name; and each unit's parent's name.
std::map<std::string, Names> plan_units_by_name(torch::nn::Module& model, const fsdp::UnitPlan& plan) {
  std::map<std::string, Names> out;
  for (int n : plan.unit_nodes) out[plan.nodes[n].name];
  for (const auto& item : model.named_parameters()) {
    const int u = plan.owner.at(item.value().unsafeGetTensorImpl());
    out[plan.nodes[plan.unit_nodes[u]].name].insert(item.key());
  }
  return out;
}

}  // namespace

// The plan alone (no process group, nothing hooked) gives the units FSDP builds for every policy
// above: the planner counts from it (train/planner.cpp).
TEST_P(FsdpWrapPolicy, ThePlanAloneGivesTheSameUnits) {
  const PolicyCase& c = GetParam();
  NestedNet net = make_nested(5);
  const fsdp::UnitPlan plan = fsdp::plan_units(*net, c.policy(net));
  ASSERT_EQ(plan.unit_nodes.size(), c.units.size()) << c.name;
  EXPECT_EQ(plan.unit_nodes[0], 0);
  EXPECT_EQ(plan.unit_parents[0], -1);
  EXPECT_EQ(plan_units_by_name(*net, plan), c.units) << c.name;
  for (size_t u = 1; u < plan.unit_nodes.size(); ++u) {
    const std::string& name = plan.nodes[plan.unit_nodes[u]].name;
    ASSERT_GE(plan.unit_parents[u], 0) << name;
    EXPECT_EQ(plan.nodes[plan.unit_nodes[plan.unit_parents[u]]].name, c.parents.at(name)) << c.name << ": " << name;
  }
}

namespace {
// group [a, b] with b.weight IS a.weight: the tie lies inside group's unit.
struct TiedGroupImpl : torch::nn::Module, nn::Hookable {
  TiedGroupImpl() {
    a = register_module("a", HookLinear(16, 16));
    b = register_module("b", HookLinear(16, 16, a->weight));
  }
  HookLinear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TiedGroup);
struct TiedNetImpl : torch::nn::Module {
  TiedNetImpl() {
    in = register_module("in", torch::nn::Linear(6, 16));
    group = register_module("group", TiedGroup());
  }
  torch::nn::Linear in{nullptr};
  TiedGroup group{nullptr};
};
TORCH_MODULE(TiedNet);
}  // namespace

// A parameter held by two units goes to the innermost unit enclosing both (here group's, not the
// root: the planner used to send every tie to the root).
TEST(FsdpUnitPlan, ATiedParameterGoesToTheInnermostUnitEnclosingItsUsers) {
  TiedNet net;
  const fsdp::UnitPlan plan = fsdp::plan_units(*net, fsdp::WrapPolicy::by_type<HookLinearImpl>());
  const fsdp::UnitPlan nested =
      fsdp::plan_units(*net, fsdp::WrapPolicy::modules({net->group.ptr(), net->group->a.ptr(), net->group->b.ptr()}));
  const auto by_name = plan_units_by_name(*net, nested);
  ASSERT_EQ(by_name.size(), 4u);
  EXPECT_EQ(by_name.at("group"), (Names{"group.a.weight", "group.b.weight"}));  // (one tensor, two names)
  EXPECT_EQ(by_name.at("group.a"), (Names{"group.a.bias", "group.a.alpha"}));
  EXPECT_EQ(by_name.at("group.b"), (Names{"group.b.bias", "group.b.alpha"}));
  EXPECT_EQ(by_name.at(""), (Names{"in.weight", "in.bias"}));
  // Without group's unit the tie goes to the root.
  EXPECT_EQ(plan_units_by_name(*net, plan).at(""), (Names{"in.weight", "in.bias", "group.a.weight", "group.b.weight"}));
}

TEST(FsdpWrapPolicyErrors, ModuleThatIsNotHookableIsNamed) {
  auto errors = errors_of(2, [](comm::ProcessGroup& pg) {
    NestedNet net = make_nested(5);
    fsdp::FullyShardedDataParallel<NestedNet>(
        net, pg, fsdp::FullyShardedOptions().wrap_policy(fsdp::WrapPolicy::modules({net->group->pre.ptr()})));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("group.pre"), std::string::npos) << "the error names the module: " << e;
    EXPECT_NE(e.find("Hookable"), std::string::npos) << "the error says what to do: " << e;
  }
  // A type policy that picks plain torch::nn::Linear modules (in the GPT: qkv, fc, lm_head, ...).
  errors = errors_of(2, [](comm::ProcessGroup& pg) {
    fsdp::FullyShardedDataParallel<models::GPT>(
        make_gpt(), pg, fsdp::FullyShardedOptions().wrap_policy(fsdp::WrapPolicy::by_type<torch::nn::LinearImpl>()));
  });
  for (const auto& e : errors) {
    EXPECT_TRUE(std::regex_search(e, std::regex("blocks\\.[01]\\.(qkv|attn_proj|fc|mlp_proj)|lm_head")))
        << "the error names a Linear module: " << e;
    EXPECT_NE(e.find("Hookable"), std::string::npos) << e;
  }
}

// --- tied, frozen, buffers ------------------------------------------------------------------------

class FsdpToyNet : public ::testing::TestWithParam<std::tuple<ShardingStrategy, int>> {};

TEST_P(FsdpToyNet, TiedFrozenAndBuffersTrainLikeOneProcess) {
  const auto [st, W] = GetParam();
  TrainSpec spec;
  spec.data = Data::Vec;
  spec.steps = 6;
  const Reference ref = train_reference(make_toy(6), spec, W);
  const Dict initial = named_values(*make_toy(6));
  // The reference itself: the tie held, frozen values did not move, trainable ones did.
  ASSERT_TRUE(at::equal(ref.values["u.weight"], ref.values["v.weight"]));
  ASSERT_TRUE(at::equal(ref.values["u.bias"], initial["u.bias"]));
  ASSERT_FALSE(at::equal(ref.values["u.alpha"], initial["u.alpha"]));
  run_ranks(W, [&, st = st, W = W](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(
        make_toy(6), pg,
        fsdp::FullyShardedOptions().sharding(st).hybrid_layout({1, W}).wrap_policy(
            fsdp::WrapPolicy::by_type<HookLinearImpl>()));
    const auto& state = model->state();
    ASSERT_EQ(state.units().size(), 3u) << state.describe();
    const int u = unit_index(state, "u"), v = unit_index(state, "v");
    ASSERT_GE(u, 0);
    ASSERT_GE(v, 0);
    // The tied weight goes to the innermost unit enclosing both uses: the root.
    const Names root_names = unit_param_names(*state.units()[0]);
    EXPECT_TRUE(root_names.count("u.weight") + root_names.count("v.weight") == 1)
        << "the tied weight is held once, by the root";
    for (int i : {u, v}) {
      const Names names = unit_param_names(*state.units()[i]);
      EXPECT_EQ(names.count("u.weight") + names.count("v.weight"), 0u) << state.units()[i]->name;
    }
    // Unit u holds its frozen bias next to its trainable alpha, in separate FlatParams.
    EXPECT_EQ(unit_param_names(*state.units()[u]), (Names{"u.bias", "u.alpha"}));
    bool frozen_flat = false, trainable_flat = false;
    for (const auto& f : state.units()[u]->flats) {
      for (const auto& e : f->entries()) {
        if (e.name == "u.bias") frozen_flat = !f->trainable();
        if (e.name == "u.alpha") trainable_flat = f->trainable();
      }
    }
    EXPECT_TRUE(frozen_flat) << "u.bias (requires_grad false) is in a frozen FlatParam";
    EXPECT_TRUE(trainable_flat);
    // The optimizer sees only trainable shards: at W=1 exactly the trainable elements.
    int64_t trainable = 0, local = 0;
    for (const auto& p : unique_params(*make_toy(6))) trainable += p.requires_grad() ? p.numel() : 0;
    for (const auto& p : model->parameters()) local += p.numel();
    if (W == 1) {
      EXPECT_EQ(local, trainable);
    }
    EXPECT_LE(local, trainable / state.groups().layout.shard + 8);

    auto opt = make_opt(spec, model->parameters());
    train(model, *opt, spec, pg.rank(), W);
    EXPECT_EQ(model->module()->count.item<float>(), 6.0f) << "the buffer is the module's own, updated in place";
    auto dict = model->full_state_dict(0);
    if (pg.rank() != 0) return;
    expect_dicts_close(dict, ref.values, 1e-5, std::string(fsdp::to_string(st)) + " W" + std::to_string(W));
    ASSERT_TRUE(dict.contains("u.weight") && dict.contains("v.weight"));
    EXPECT_TRUE(at::equal(dict["u.weight"], dict["v.weight"])) << "tied aliases carry one value";
    for (const char* frozen : {"u.bias", "scale"}) {
      ASSERT_TRUE(dict.contains(frozen));
      EXPECT_TRUE(at::equal(dict[frozen], initial[frozen])) << frozen << " is frozen and must not change";
    }
    for (const char* buffer : {"count", "u.gain", "v.gain"}) ASSERT_TRUE(dict.contains(buffer)) << buffer;
    EXPECT_EQ(dict["count"].item<float>(), 6.0f);
    EXPECT_TRUE(at::equal(dict["u.gain"], initial["u.gain"]));
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, FsdpToyNet,
                         ::testing::Combine(::testing::Values(ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp,
                                                              ShardingStrategy::HybridShard),
                                            ::testing::Values(1, 2, 3)),
                         StrategyWorldName());

TEST(FsdpSyncModuleStates, ParametersAndBuffersComeFromRankZero) {
  const Dict rank0 = named_values(*make_toy(10));
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    ToyNet net = make_toy(10 + pg.rank());
    net->count.fill_(100 * pg.rank());
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(
        net, pg, fsdp::FullyShardedOptions().wrap_policy(fsdp::WrapPolicy::by_type<HookLinearImpl>()));
    EXPECT_EQ(model->module()->count.item<float>(), 0.0f) << "rank " << pg.rank() << ": buffers broadcast from rank 0";
    auto dict = model->full_state_dict(0);
    if (pg.rank() == 0) expect_dicts_close(dict, rank0, 0, "sync_module_states");
  });
}

TEST(FsdpSyncModuleStates, OffKeepsEachRanksOwnValues) {
  const Dict rank0 = named_values(*make_toy(10));
  run_ranks(3, [&](comm::ProcessGroup& pg) {
    auto model = fsdp::FullyShardedDataParallel<ToyNet>(make_toy(10 + pg.rank()), pg,
                                                        fsdp::FullyShardedOptions().sync_module_states(false));
    auto dict = model->full_state_dict(0);
    if (pg.rank() != 0) return;
    // Each rank's shard kept its own values: some parameter differs from rank 0's model.
    int differing = 0;
    for (const auto& it : rank0) {
      if (dict.contains(it.key()) && !at::equal(dict[it.key()], it.value())) ++differing;
    }
    EXPECT_GT(differing, 0) << "without sync_module_states ranks 1 and 2 keep their own parameters";
  });
}

// --- layout ----------------------------------------------------------------------------------------

TEST(FsdpLayout, ValidationNamesTheDegreesAndTheWorldSize) {
  try {
    fsdp::MeshLayout{3, 2}.validate(4);
    FAIL() << "replicate 3 x shard 2 on 4 ranks must throw";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("replicate 3 x shard 2"), std::string::npos) << msg;
    EXPECT_TRUE(std::regex_search(msg, std::regex("\\b4\\b"))) << "names the world size: " << msg;
  }
  EXPECT_THROW(fsdp::MeshLayout({0, 4}).validate(4), std::exception);
  EXPECT_THROW(fsdp::MeshLayout({4, 0}).validate(4), std::exception);
  EXPECT_THROW(fsdp::MeshLayout({-2, -2}).validate(4), std::exception);
  EXPECT_NO_THROW(fsdp::MeshLayout({2, 2}).validate(4));
  EXPECT_EQ(fsdp::MeshLayout({2, 4}).describe(), "replicate 2 x shard 4");

  // Through the wrapper: every rank fails the same way, before any collective can hang.
  auto errors = errors_of(4, [](comm::ProcessGroup& pg) {
    fsdp::FullyShardedDataParallel<models::GPT>(
        make_gpt(), pg, fsdp::FullyShardedOptions().sharding(ShardingStrategy::HybridShard).hybrid_layout({3, 2}));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("replicate 3 x shard 2"), std::string::npos) << e;
    EXPECT_TRUE(std::regex_search(e, std::regex("\\b4\\b"))) << e;
  }
}

TEST(FsdpLayout, ParseShardingAndLayoutFor) {
  for (const char* name : {"full", "grad_op", "none", "hybrid"}) {
    EXPECT_EQ(std::string(fsdp::to_string(fsdp::parse_sharding(name))), name);
  }
  try {
    fsdp::parse_sharding("bad");
    FAIL() << "parse_sharding(\"bad\") must throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("bad"), std::string::npos) << e.what();
  }
  auto eq = [](fsdp::MeshLayout l, int r, int s) { return l.replicate == r && l.shard == s; };
  EXPECT_TRUE(eq(fsdp::layout_for(ShardingStrategy::FullShard, 4), 1, 4));
  EXPECT_TRUE(eq(fsdp::layout_for(ShardingStrategy::ShardGradOp, 3), 1, 3));
  EXPECT_TRUE(eq(fsdp::layout_for(ShardingStrategy::NoShard, 4), 4, 1));
  EXPECT_TRUE(eq(fsdp::layout_for(ShardingStrategy::HybridShard, 4, {2, 2}), 2, 2));
  EXPECT_THROW(fsdp::layout_for(ShardingStrategy::HybridShard, 4, {3, 2}), std::exception);
  const char* saved = std::getenv("LOCAL_WORLD_SIZE");
  const std::string saved_value = saved ? saved : "";
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  EXPECT_TRUE(eq(fsdp::layout_for(ShardingStrategy::HybridShard, 4), 2, 2)) << "shard 0: ranks per node";
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_TRUE(eq(fsdp::layout_for(ShardingStrategy::HybridShard, 4), 1, 4)) << "no LOCAL_WORLD_SIZE: shard over all";
  if (saved) ::setenv("LOCAL_WORLD_SIZE", saved_value.c_str(), 1);
}

TEST(FsdpLayout, HybridGroups) {
  run_ranks(4, [](comm::ProcessGroup& pg) {
    const int r = pg.rank();
    auto g = fsdp::make_groups(pg, {2, 2});
    EXPECT_EQ(g.shard.size(), 2);
    EXPECT_EQ(g.replicate.size(), 2);
    EXPECT_EQ(g.shard.global_ranks(), (std::vector<int>{r / 2 * 2, r / 2 * 2 + 1})) << "rank " << r;
    EXPECT_EQ(g.replicate.global_ranks(), (std::vector<int>{r % 2, r % 2 + 2})) << "rank " << r;
    EXPECT_EQ(g.shard.rank(), r % 2);
    EXPECT_EQ(g.replicate.rank(), r / 2);
  });
}
