// The memory planner's arithmetic and choice (Design note [memory plan], train/planner.h); the
// predictions against measured peaks are in tests/examples/memory_plan_test.cpp.
#include "dtrain/train/planner.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>

#include "dtrain/util/memory.h"

using namespace dtrain;
using train::Candidate;
using train::ModelFacts;

namespace {

ModelFacts facts() {
  ModelFacts f;
  f.param_numels = {1000, 4000, 4000, 1000};  // 10,000 elements, 40,000 bytes
  f.unit_numels = {2000, 4000, 4000};         // root and two nested units
  f.activation_bytes = 100000;
  f.recompute_activation_bytes = 30000;
  f.other_bytes = 500;
  f.buffer_bytes = 100;
  return f;
}

const Candidate& find(const train::MemoryPlan& p, const std::string& name) {
  for (const auto& c : p.candidates) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no candidate " + name);
}

}  // namespace

TEST(MemoryPlanner, ParsesSizes) {
  EXPECT_EQ(train::parse_memory_size("--memory-budget", "512MiB"), 512LL << 20);
  EXPECT_EQ(train::parse_memory_size("--memory-budget", "4GiB"), 4LL << 30);
  EXPECT_EQ(train::parse_memory_size("--memory-budget", "1.5GB"), 1500000000LL);
  EXPECT_EQ(train::parse_memory_size("--memory-budget", "1000"), 1000);
  EXPECT_EQ(train::parse_memory_size("--memory-budget", "64KiB"), 65536);
  for (const char* bad : {"", "MiB", "-1GiB", "4 GiB", "4gib", "0", "1.2.3MiB"}) {
    try {
      train::parse_memory_size("--memory-budget", bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--memory-budget expects a size"), std::string::npos) << e.what();
    }
  }
}

TEST(MemoryPlanner, CountsEachStrategysState) {
  train::TrainConfig cfg;
  const ModelFacts f = facts();
  const auto plan = train::plan_memory(cfg, 2, f, 0);
  ASSERT_EQ(plan.candidates.size(), 5u);
  EXPECT_EQ(plan.chosen, -1);  // (no budget)
  const Candidate& ddp = find(plan, "ddp");
  EXPECT_EQ(ddp.params, 40000);
  EXPECT_EQ(ddp.grads, 40000);
  EXPECT_EQ(ddp.optimizer, 80000);           // AdamW: two states
  EXPECT_EQ(ddp.step_extra, 100000);         // the activations (> AdamW's 2 x 16,000 temporaries)
  EXPECT_EQ(ddp.other, 600);
  const Candidate& z1 = find(plan, "zero1");
  EXPECT_EQ(z1.optimizer, 2 * 4 * 5000);     // partition_greedy: 4000 + 1000 on each rank
  const Candidate& z2 = find(plan, "zero2");
  EXPECT_EQ(z2.grads, 4 * 5000);
  const Candidate& fsdp = find(plan, "fsdp");
  EXPECT_EQ(fsdp.params, 4 * (1000 + 2000 + 2000));  // each unit's padded shard
  EXPECT_EQ(fsdp.optimizer, 2 * fsdp.params);
  EXPECT_EQ(find(plan, "fsdp+recompute").step_extra, 30000);
  // Three ranks: units of 2000 and 4000 elements pad to 667 and 1334 per rank.
  EXPECT_EQ(find(train::plan_memory(cfg, 3, f, 0), "fsdp").params, 4 * (667 + 1334 + 1334));
  train::TrainConfig sgd;
  sgd.optimizer = "sgd";
  EXPECT_EQ(find(train::plan_memory(sgd, 2, f, 0), "ddp").optimizer, 40000);  // momentum only
  // One rank: single, with and without recomputation.
  const auto one = train::plan_memory(cfg, 1, f, 0);
  ASSERT_EQ(one.candidates.size(), 2u);
  EXPECT_EQ(one.candidates[0].name, "single");
  EXPECT_EQ(one.candidates[1].name, "single+recompute");
  EXPECT_LT(one.candidates[1].total(), one.candidates[0].total());
}

// --secondary-shard node (Design note [secondary shards]): the nested units' node copies, 1 / L of
// each padded unit: on the CPU in FSDP's pool (kept through the step), on a GPU alongside the
// activations; only where the shard group spans nodes. --hierarchical-all-reduce on the CPU: a
// workspace the size of the gradients (Design note [two-level all-reduce]).
TEST(MemoryPlanner, CountsSecondaryShardsAndTwoLevelWorkspacesWhereTheRanksSpanNodes) {
  train::TrainConfig cfg;
  cfg.secondary_shard = "node";
  const char* old = std::getenv("LOCAL_WORLD_SIZE");
  const std::string saved = old ? old : "";
  setenv("LOCAL_WORLD_SIZE", "4", 1);  // (one node: nothing kept)
  const Candidate one_node = find(train::plan_memory(cfg, 4, facts(), 0), "fsdp");
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  const auto plan = train::plan_memory(cfg, 4, facts(), 0);
  ASSERT_EQ(plan.candidates.size(), 2u);  // (fsdp's only)
  EXPECT_EQ(find(plan, "fsdp").buffers, one_node.buffers + 4 * (4000 + 4000) / 2);
  EXPECT_EQ(find(plan, "fsdp").step_extra, 100000);
  ModelFacts gpu = facts();
  gpu.on_cpu = false;
  EXPECT_EQ(find(train::plan_memory(cfg, 4, gpu, 0), "fsdp").step_extra, 100000 + 4 * (4000 + 4000) / 2);
  train::TrainConfig hier;
  hier.hierarchical_all_reduce = true;
  const auto ddp_plan = train::plan_memory(hier, 4, facts(), 0);
  ASSERT_EQ(ddp_plan.candidates.size(), 2u);  // (ddp and zero1)
  EXPECT_EQ(find(ddp_plan, "ddp").buffers, 40000);
  EXPECT_EQ(find(ddp_plan, "zero1").buffers, 40000);
  EXPECT_EQ(find(train::plan_memory(hier, 4, gpu, 0), "ddp").buffers, 0);
  if (old) {
    setenv("LOCAL_WORLD_SIZE", saved.c_str(), 1);
  } else {
    unsetenv("LOCAL_WORLD_SIZE");
  }
}

TEST(MemoryPlanner, ActivationCheckpointingGivenMakesEveryCandidateRecompute) {
  train::TrainConfig cfg;
  cfg.activation_checkpointing = true;
  const auto plan = train::plan_memory(cfg, 2, facts(), 0);
  ASSERT_EQ(plan.candidates.size(), 4u);
  for (const auto& c : plan.candidates) {
    EXPECT_TRUE(c.plan.recompute) << c.name;
    EXPECT_NE(c.name.find("+recompute"), std::string::npos) << c.name;
    EXPECT_EQ(c.step_extra >= 30000, true) << c.name;
  }
  EXPECT_EQ(find(plan, "ddp+recompute").step_extra, 32000);  // (AdamW's temporaries of the largest tensor now)
  const auto one = train::plan_memory(cfg, 1, facts(), 0);
  ASSERT_EQ(one.candidates.size(), 1u);
  EXPECT_EQ(one.candidates[0].name, "single+recompute");
}

TEST(MemoryPlanner, ChoosesTheFirstThatFitsInThePreferenceOrder) {
  train::TrainConfig cfg;
  const ModelFacts f = facts();
  const auto all = train::plan_memory(cfg, 2, f, 0);
  for (size_t i = 0; i < all.candidates.size(); ++i) {
    const int64_t budget = all.candidates[i].total();
    const auto p = train::plan_memory(cfg, 2, f, budget);
    ASSERT_GE(p.chosen, 0);
    EXPECT_LE(p.chosen, static_cast<int>(i));  // this one fits; an earlier one may too
    EXPECT_LE(p.candidates[p.chosen].total(), budget);
    for (int j = 0; j < p.chosen; ++j) EXPECT_GT(p.candidates[j].total(), budget);
    EXPECT_EQ(&train::chosen(p), &p.candidates[p.chosen]);
  }
  // Every candidate is a validated plan at the request's global batch (2 ranks x 8).
  for (const auto& c : all.candidates) {
    EXPECT_NO_THROW(c.plan.validate(2)) << c.name;
    EXPECT_EQ(c.plan.batch.global, 16) << c.name;
    EXPECT_EQ(c.name, c.plan.name());
  }
}

TEST(MemoryPlanner, TensorParallelCandidatesComposeWithWhatTPAllows) {
  train::TrainConfig cfg;
  ModelFacts pieces = facts();  // (a rank's pieces at TP 2: half of each matrix)
  for (auto& n : pieces.param_numels) n /= 2;
  for (auto& n : pieces.unit_numels) n /= 2;
  pieces.activation_bytes = 60000;
  pieces.recompute_activation_bytes = 20000;
  // W=4, TP 2: every data-parallel kind over 2 data-parallel ranks, at the global batch of 4 x 8
  // (each accumulating two micro-batches).
  const auto four = train::tensor_parallel_candidates(cfg, 4, 2, true, pieces);
  std::vector<std::string> names;
  for (const auto& c : four) names.push_back(c.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tp2+sp+ddp", "tp2+sp+zero1", "tp2+sp+zero2", "tp2+sp+fsdp",
                                              "tp2+sp+fsdp+recompute"}));
  for (const auto& c : four) {
    EXPECT_EQ(c.plan.layout.tensor, 2);
    EXPECT_TRUE(c.plan.sequence_parallel);
    EXPECT_EQ(c.plan.batch.global, 32);
    EXPECT_EQ(c.plan.batch.accumulation, 2);
  }
  // Counted on world / TP ranks from the pieces' facts: as the data-parallel plan of 2 ranks (the
  // replicated and recomputed kinds do not depend on the accumulation).
  const auto dp2 = train::plan_memory(cfg, 2, pieces, 0);
  EXPECT_EQ(four[0].total(), find(dp2, "ddp").total());
  EXPECT_EQ(four[1].total(), find(dp2, "zero1").total());
  // W=2, TP 2: nothing around it (single, with and without recomputation).
  const auto two = train::tensor_parallel_candidates(cfg, 2, 2, false, pieces);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[0].name, "tp2");
  EXPECT_EQ(two[0].plan.data, dtrain::parallel::DataParallel::None);
  EXPECT_EQ(two[1].name, "tp2+recompute");
  EXPECT_EQ(two[1].step_extra, 20000);
  EXPECT_THROW(train::tensor_parallel_candidates(cfg, 3, 2, false, pieces), c10::Error);

  // After the data-parallel candidates, by degree, then recomputation, then sequence parallelism;
  // pipeline parallelism last; the choice carries the layout into the configuration.
  cfg.strategy = "auto";
  auto plan = train::plan_memory(cfg, 2, facts(), 0);
  train::add_candidates(plan, train::tensor_parallel_candidates(cfg, 2, 2, true, pieces));
  Candidate pp2 = plan.candidates[0];
  pp2.plan.layout = {1, 1, 2, 1};
  pp2.plan.data = dtrain::parallel::DataParallel::None;
  pp2.plan.recompute = true;
  pp2.name = pp2.plan.name();
  pp2.params = pp2.grads = pp2.optimizer = pp2.buffers = pp2.other = 0;
  pp2.step_extra = 1;
  train::add_candidates(plan, {pp2});
  train::add_candidates(plan, train::tensor_parallel_candidates(cfg, 2, 2, false, pieces));
  names.clear();
  for (const auto& c : plan.candidates) names.push_back(c.name);
  EXPECT_EQ(names, (std::vector<std::string>{"ddp", "zero1", "zero2", "fsdp", "fsdp+recompute", "tp2", "tp2+sp",
                                              "tp2+recompute", "tp2+sp+recompute", "pp2+recompute"}));
  EXPECT_EQ(train::chosen([&] {
              auto p = plan;
              p.budget = 1000;
              train::choose(p);
              return p;
            }()).plan.layout.pipeline, 2);  // (the smallest: only it fits)
  plan.budget = find(plan, "tp2+recompute").total();
  ASSERT_LT(plan.budget, find(plan, "fsdp+recompute").total());
  train::choose(plan);
  ASSERT_EQ(train::chosen(plan).name, "tp2+recompute");
  const dtrain::parallel::Plan& chosen = train::chosen(plan).plan;
  EXPECT_EQ(chosen.data, dtrain::parallel::DataParallel::None);
  EXPECT_EQ(chosen.layout.tensor, 2);
  EXPECT_FALSE(chosen.sequence_parallel);
  EXPECT_TRUE(chosen.recompute);
}

TEST(MemoryPlanner, NothingFitsNamesTheSmallestNeed) {
  train::TrainConfig cfg;
  const auto p = train::plan_memory(cfg, 2, facts(), 1000);
  EXPECT_EQ(p.chosen, -1);
  int64_t least = p.candidates[0].total();
  std::string least_name = p.candidates[0].name;
  for (const auto& c : p.candidates) {
    if (c.total() < least) least = c.total(), least_name = c.name;
  }
  try {
    train::chosen(p);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("too small: the smallest need is " + least_name + " at " + train::format_bytes(least)),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("on 2 rank(s)"), std::string::npos) << msg;
  }
  const std::string table = train::format_plan(p, "prog");
  EXPECT_NE(table.find("prog: memory plan per rank, 2 ranks"), std::string::npos) << table;
  EXPECT_NE(table.find("(over budget)"), std::string::npos) << table;
}

TEST(MemoryPlanner, FlagsThatDoNotFitAreClearErrors) {
  auto error = [](const std::vector<std::string>& args) {
    try {
      train::parse_config(args);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error({"--strategy", "auto", "--tp", "2"}).find("--strategy auto picks the layout itself"),
            std::string::npos);
  EXPECT_NE(error({"--strategy", "ddp", "--memory-budget", "1GiB"}).find("--memory-budget applies to --strategy auto"),
            std::string::npos);
  EXPECT_NE(error({"--plan", "--pp", "2"}).find("--plan lists the layouts itself"), std::string::npos);
  EXPECT_NE(error({"--strategy", "auto", "--memory-budget", "lots"}).find("--memory-budget expects a size"),
            std::string::npos);
  EXPECT_NE(error({"--strategy", "auto", "--sharding", "full"}).find("apply to --strategy fsdp or hsdp"), std::string::npos);
  EXPECT_EQ(error({"--strategy", "auto", "--memory-budget", "2GiB"}), "");
  EXPECT_EQ(error({"--strategy", "fsdp", "--plan", "--memory-budget", "2GiB"}), "");
}

// detail::RssPeak (Design note [memory plan], its RSS paragraph): a phase's peak RSS besides its
// counted tensors. Counted tensors the phase touches are not in it: allocating and filling 48 MiB
// of tensors moves the figure by far less than 48 MiB; off the CPU, or uncounted, it is -1.
TEST(MemoryPlanner, RssPeakLeavesOutTheCountedTensors) {
  util::count_cpu_allocations();
  const c10::Device cpu(c10::kCPU);
  train::detail::RssPeak idle(cpu);
  idle.start();
  util::reset_cpu_peak_bytes();
  const int64_t without = idle.besides(util::cpu_peak_bytes());
  ASSERT_GT(without, 0);

  train::detail::RssPeak busy(cpu);
  busy.start();
  util::reset_cpu_peak_bytes();
  {
    at::Tensor t = at::empty({12 << 20}, at::kFloat);  // 48 MiB, every page written
    t.fill_(1.0f);
    EXPECT_EQ(t.sum().item<float>(), static_cast<float>(12 << 20));
  }
  const int64_t with = busy.besides(util::cpu_peak_bytes());
  EXPECT_NEAR(static_cast<double>(with), static_cast<double>(without), 12.0 * 1048576)
      << "the 48 MiB of counted tensors leaked into the figure besides them (or out of the peak RSS)";

  EXPECT_EQ(train::detail::RssPeak(c10::Device(c10::kCUDA, 0)).besides(0), -1);
}
