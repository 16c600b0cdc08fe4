// The memory planner (train/planner.h) on the demo's shapes and on a user's model: every
// candidate's predicted per-rank peak is within 10% of the peak its run measures (counted tensor
// allocations, util/memory.h), at W = 1, 2, 3 (some at 4), and so is its predicted peak RSS (on
// the allocator dtrun preloads by default; on glibc's FSDP's on a state-heavy model is a lower
// bound); --strategy auto picks the first that fits a budget
// and trains with it; a budget nothing fits is an error naming the smallest need.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <torch/cuda.h>

#include "dtrain/launch/allocator.h"
#include "dtrain/util/fs.h"
#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::launch_ranks;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {

struct Planned {
  std::string strategy;
  bool recompute = false;
  int tp = 1, pp = 1;
  bool sequence_parallel = false;
  int index = 0;  // the order of preference
  double predicted_mib = 0;
  double predicted_rss_mib = -1;
  bool chosen = false;
  double budget_mib = 0;  // (0: the plan had none)
};

// The plan's records in a metrics file written by --plan.
std::map<std::string, Planned> read_plan(const std::string& path) {
  std::map<std::string, Planned> out;
  std::ifstream in(path);
  static const std::regex plan("\"plan\": \"([a-z0-9+]+)\"");
  static const std::regex strategy("\"strategy\": \"([a-z0-9]+)\"");
  for (std::string line; std::getline(in, line);) {
    std::smatch m, s;
    if (!std::regex_search(line, m, plan) || !std::regex_search(line, s, strategy)) continue;
    const Fields f = numeric_fields(line);
    Planned p;
    p.strategy = s[1];
    p.recompute = line.find("\"recompute\": true") != std::string::npos;
    p.predicted_mib = f.at("predicted_peak_mib");
    p.predicted_rss_mib = f.at("predicted_rss_mib");
    p.chosen = line.find("\"chosen\": true") != std::string::npos;
    if (f.count("budget_mib")) p.budget_mib = f.at("budget_mib");
    p.tp = static_cast<int>(f.at("tp"));
    p.pp = static_cast<int>(f.at("pp"));
    p.sequence_parallel = line.find("\"sequence_parallel\": true") != std::string::npos;
    p.index = static_cast<int>(out.size());
    out[m[1]] = p;
  }
  return out;
}

std::map<std::string, Planned> plan(const std::string& program, int world, const std::string& args, std::string* output = nullptr) {
  auto execute = [&] {
    const std::string metrics = temp_dir() + "/plan.jsonl";
    // (Design note [test launches], testing/testing.h)
    auto r = launch_ranks(bin(program) + args + " --plan --metrics " + metrics, world, 120);
    std::ifstream in(metrics);
    std::stringstream text;
    text << in.rdbuf();
    return dtrain::testing::SharedRun{r.exit_code, r.output, text.str()};
  };
  // Several tests print the same table (Design note [shared runs], testing/testing.h); not one whose
  // default budget is the memory available now.
  const bool now = args.find("--strategy auto") != std::string::npos && args.find("--memory-budget") == std::string::npos;
  const dtrain::testing::SharedRun res =
      now ? execute() : dtrain::testing::shared_run(program + " plan W" + std::to_string(world) + args, {program, "dtrun"}, execute);
  EXPECT_EQ(res.exit_code, 0) << res.output;
  if (output) *output = res.output;
  const std::string path = temp_dir() + "/plan.jsonl";
  std::ofstream(path) << res.metrics;
  return read_plan(path);
}

// The plan table a run printed (rank 0): each row's name, predicted peak (MiB) and whether it is
// marked over the budget, and the row marked chosen (-1: none).
struct Row {
  std::string name;
  double peak_mib = 0;
  bool over_budget = false;
};
std::pair<std::vector<Row>, int> table_of(const std::string& output) {
  static const std::regex row(
      R"(\[0\]:([* ]) (\S+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+) MiB([^\n]*))");
  std::vector<Row> rows;
  int starred = -1;
  for (std::sregex_iterator it(output.begin(), output.end(), row), end; it != end; ++it) {
    if ((*it)[1] == "*") starred = static_cast<int>(rows.size());
    rows.push_back({(*it)[2], std::stod((*it)[3]), (*it)[4].str().find("(over budget)") != std::string::npos});
  }
  return {rows, starred};
}

// The flags that train candidate p by hand.
std::string flags_of(const Planned& p) {
  return " --strategy " + p.strategy + (p.recompute ? " --activation-checkpointing" : "") +
         (p.tp > 1 ? " --tp " + std::to_string(p.tp) : "") + (p.pp > 1 ? " --pp " + std::to_string(p.pp) : "") + (p.sequence_parallel ? " --sequence-parallel" : "");
}

// Runs the plan's candidates (`only`: those named; empty: every one, and there must be `count`)
// and checks each measured peak (the rank with the most) against the prediction: the counted
// tensors' and the RSS within 10%, or for the candidates in `rss_bound` the RSS a lower bound.
void expect_predictions_hold(const std::string& program, int world, const std::string& args, size_t count,
                             const std::set<std::string>& only = {}, const std::set<std::string>& rss_bound = {}) {
  const auto candidates = plan(program, world, args);
  ASSERT_EQ(candidates.size(), count);
  std::map<std::string, std::pair<double, double>> rss_of;  // (predicted, measured) where within 10% is checked
  for (const auto& name : only) ASSERT_TRUE(candidates.count(name)) << name;
  for (const auto& [name, p] : candidates) {
    if (!only.empty() && !only.count(name)) continue;
    const std::string how = flags_of(p);
    const GptRun run = run_program(program, world, args + how);
    ASSERT_EQ(run.exit_code, 0) << name << "\n" << run.output;
    ASSERT_TRUE(run.summary.count("peak_tensor_mib")) << name;
    const double measured = run.summary.at("peak_tensor_mib");
    std::printf("%s W=%d %-16s predicted %6.1f MiB, measured %6.1f MiB (%+.1f%%)\n", program.c_str(), world, name.c_str(),
                p.predicted_mib, measured, 100.0 * (p.predicted_mib - measured) / measured);
    EXPECT_NEAR(p.predicted_mib, measured, 0.10 * measured)
        << program << " W=" << world << " " << name << ": predicted " << p.predicted_mib << " MiB, measured " << measured;
    if (p.predicted_rss_mib < 0) {  // (no RSS figure on CUDA: the peak is the device's)
      EXPECT_NE(args.find("--device cuda"), std::string::npos) << name << ": no predicted RSS on the CPU";
      EXPECT_TRUE(run.summary.count("peak_gpu_mib")) << name;
      continue;
    }
    // RSS: the counted peak plus what the process held besides tensors at the measurement's peak
    // (libtorch, Gloo, the BLAS, the heap's free blocks then) against the run's peak RSS (the rank
    // with the most); docs/memory_planner.md has the figures.
    ASSERT_FALSE(run.steps.empty());
    const double rss = run.steps.back().at("peak_rss_mib");
    std::printf("%s W=%d %-16s predicted RSS %4.0f MiB, measured %4.0f MiB (%+.1f%%)\n", program.c_str(), world, name.c_str(),
                p.predicted_rss_mib, rss, 100.0 * (p.predicted_rss_mib - rss) / rss);
    if (!rss_bound.count(name)) {
      EXPECT_NEAR(p.predicted_rss_mib, rss, 0.10 * rss)
          << program << " W=" << world << " " << name << ": predicted RSS " << p.predicted_rss_mib << " MiB, measured " << rss;
      rss_of[name] = {p.predicted_rss_mib, rss};
      continue;
    }
    EXPECT_LE(p.predicted_rss_mib, rss * 1.05)
        << program << " W=" << world << " " << name << ": predicted RSS " << p.predicted_rss_mib << " MiB, measured " << rss;
    EXPECT_GE(p.predicted_rss_mib, rss * 0.75)
        << program << " W=" << world << " " << name << ": predicted RSS " << p.predicted_rss_mib << " MiB, measured " << rss;
  }
  // What the RSS predictions share (the libraries, ~190 MiB) would pass 10% with the candidates'
  // own part wrong, so the spread between the candidates predicted largest and smallest must be
  // the measured spread within 20 MiB: a run's peak RSS varies by up to 10 MiB between runs, and
  // the heap's free blocks a strategy leaves behind differ (ZeRO-2 measures 11-13 MiB above its
  // prediction at W = 2 on the state-heavy GPT, pipeline parallelism 2-3 MiB below: CI measured a
  // spread 15.7 MiB off). Each candidate's counted part is checked on its own above.
  if (rss_of.size() >= 2) {
    auto by_prediction = [](const auto& a, const auto& b) { return a.second.first < b.second.first; };
    const auto lo = std::min_element(rss_of.begin(), rss_of.end(), by_prediction);
    const auto hi = std::max_element(rss_of.begin(), rss_of.end(), by_prediction);
    EXPECT_NEAR(hi->second.first - lo->second.first, hi->second.second - lo->second.second, 20.0)
        << program << " W=" << world << ": " << hi->first << " predicted " << hi->second.first << " MiB RSS, measured "
        << hi->second.second << "; " << lo->first << " predicted " << lo->second.first << ", measured " << lo->second.second;
  }
}

constexpr const char* kDemo = " --steps 2 --threads 1";  // the demo's shapes (4 layers, d_model 128, T 128, batch 8)
// Model state larger than the activations: the strategies' own terms dominate.
constexpr const char* kStateHeavy = " --steps 2 --threads 1 --d-model 256 --seq-len 32 --batch-size 2";

// The budget `--strategy auto --plan` chose by default (no --memory-budget), in MiB, from its records.
double default_budget_mib(int world, const std::string& args) {
  const auto candidates = plan("dtrain-gpt", world, std::string(kDemo) + args + " --strategy auto");
  if (candidates.empty()) {
    ADD_FAILURE() << "no plan records";
    return 0;
  }
  const double budget = candidates.begin()->second.budget_mib;
  EXPECT_GT(budget, 0) << "no budget_mib in the plan records";
  return budget;
}

// MemAvailable in /proc/meminfo, MiB.
double mem_available_mib() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stod(line.substr(13)) / 1024.0;
  }
  return 0;
}

}  // namespace

// On the CPU the default budget is the available memory shared by the node's ranks (read while the
// ranks run: at most what the test reads before and after, over 2, and not far below).
TEST(MemoryPlan, TheDefaultBudgetIsTheAvailableMemoryPerLocalRank) {
  const double before = mem_available_mib();
  ASSERT_GT(before, 0);
  const double budget = default_budget_mib(2, "");
  const double most = std::max(before, mem_available_mib()) / 2;
  EXPECT_LE(budget, most * 1.05) << "MemAvailable " << before << " MiB before";
  EXPECT_GE(budget, most * 0.5) << "MemAvailable " << before << " MiB before";
}

class MemoryPlanDemo : public ::testing::TestWithParam<int> {};

TEST_P(MemoryPlanDemo, EveryCandidatePredictsItsPeakWithinTenPercent) {
  // W=1: single, single+recompute; W=2: ddp, zero1, zero2, fsdp, fsdp+recompute, tp2, tp2+sp and
  // both recomputed, pp2 and pp2+recompute. (W = 3's world-dependent kinds run on the state-heavy
  // model below; the demo's shapes at W = 3 were cut for CI's time.)
  const int world = GetParam();
  expect_predictions_hold("dtrain-gpt", world, kDemo, world == 1 ? 2u : 11u);
}

INSTANTIATE_TEST_SUITE_P(Worlds, MemoryPlanDemo, ::testing::Values(1, 2),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(MemoryPlan, PredictionsHoldWhenModelStateDominates) {
  // The ranks run on the allocator dtrun preloads by default (launch_ranks; Design note [the
  // workers' allocator]), where FSDP's RSS is within 10% too. On glibc's (neither tcmalloc nor
  // jemalloc installed) it is a lower bound: FSDP's gathered units and gradient blocks (2.5 MiB
  // each, a dozen freed and taken again per step) fragment glibc's main heap, which then holds
  // 30-60 MiB free at the peak where the measured passes' held a few (measured 12-18% above the
  // prediction at W = 2, 6-10% at W = 3; docs/memory_planner.md).
  const bool glibc = dtrain::launch::choose_allocator("auto", [](const std::string& p) {
                       return dtrain::util::fs::exists(p);
                     }).kind == dtrain::launch::Allocator::System;
  const std::set<std::string> fsdp = glibc ? std::set<std::string>{"fsdp", "fsdp+recompute"} : std::set<std::string>{};
  // (the strategies' own terms: each kind once, recomputation with FSDP whose RSS is a bound; the
  // demo's shapes run every candidate, recomputation's activations there)
  // (no tp2+sp: sequence parallelism changes activations only, which this model's state dwarfs;
  // the demo's shapes run it. W = 3: the kinds whose terms depend on the world.)
  expect_predictions_hold("dtrain-gpt", 2, kStateHeavy, 11, {"ddp", "zero1", "zero2", "fsdp", "fsdp+recompute", "tp2", "pp2"}, fsdp);
  expect_predictions_hold("dtrain-gpt", 3, kStateHeavy, 5, {"zero1", "zero2", "fsdp"}, fsdp);
  // Accumulation: full gradients under no_sync (FSDP keeps them to the step).
  // (9: --pp 2's two micro-batches do not divide the batch of 1; the kinds whose counting changes
  // under accumulation run: full gradients kept (ddp; zero1 keeps them alike), reduced to shards
  // (zero2), FSDP's; TP's is that of the runs above)
  expect_predictions_hold("dtrain-gpt", 2, std::string(kStateHeavy) + " --batch-size 1 --grad-accum 2", 9,
                          {"ddp", "zero2", "fsdp"}, fsdp);
}

TEST(MemoryPlan, TensorParallelAroundDataParallelAtFourRanks) {
  // W=4: TP 2 inside every data-parallel kind over 2 data-parallel ranks, TP 4, PP 2 inside ddp,
  // PP 4, TP 2 x PP 2; some of the 25 candidates run (each at the global batch of 4 x 8): TP around
  // FSDP, TP 4 with sequence parallelism and recomputation, TP x PP. (TP around DDP and PP around
  // DDP were cut for CI's time: W = 2's sweep runs TP and PP, and their data-parallel terms are
  // those of ddp's.)
  expect_predictions_hold("dtrain-gpt", 4, kDemo, 25, {"tp2+fsdp", "tp4+sp+recompute", "tp2+pp2"});
}

TEST(MemoryPlan, UsersModelThroughTheLibraryLoop) {
  // dtrain-mlp: a Sequential of the user's, FSDP units and recomputation by its own hooks.
  // (TP 2 with its ParallelRegressor; no sequence parallelism: the MLP has none)
  expect_predictions_hold("dtrain-mlp", 2, " --hidden 512 --depth 4 --samples 256 --batch-size 16 --steps 2 --threads 1", 9);
}

TEST(MemoryPlan, AutoTrainsWithTheFastestThatFits) {
  const auto candidates = plan("dtrain-gpt", 2, kDemo);
  ASSERT_EQ(candidates.size(), 11u);
  std::vector<std::string> preference(candidates.size());  // the plan's order
  for (const auto& [name, p] : candidates) preference.at(p.index) = name;
  EXPECT_EQ(std::vector<std::string>(preference.begin(), preference.begin() + 5),
            (std::vector<std::string>{"ddp", "zero1", "zero2", "fsdp", "fsdp+recompute"}));
  // For a budget just over each candidate's need (4% over: a run measures again, and a measurement
  // varies a little between runs): the first of the preference order that fits (each choice once),
  // trained like one process at the same global batch.
  const GptRun single = run_program("dtrain-gpt", 1, std::string(kDemo) + " --strategy single --batch-size 16");
  // The budgets: the smallest need's first (below every other), then each candidate's in the
  // preference order, until four choices trained (each a planned run: ~10 s of CI's time).
  std::string smallest = preference[0];
  for (const auto& [name, p] : candidates) smallest = p.predicted_mib < candidates.at(smallest).predicted_mib ? name : smallest;
  std::vector<std::string> budgets_of{smallest};
  for (const auto& n : preference) budgets_of.push_back(n);
  std::set<std::string> picked;
  for (const auto& name : budgets_of) {
    if (picked.size() == 4) break;
    const double budget_mib = candidates.at(name).predicted_mib * 1.04;
    std::string expected;
    for (const auto& n : preference) {
      if (candidates.at(n).predicted_mib <= budget_mib) {
        expected = n;
        break;
      }
    }
    // (tp2+recompute: PlannedLayout/tp2 trains the same choice against the layout named by hand;
    // tp2+sp: its choice differs from tp2's by the flag only, which the table's row checks)
    if (picked.count(expected) || expected == "tp2+recompute" || expected == "tp2+sp") continue;
    const GptRun run = run_program("dtrain-gpt", 2, std::string(kDemo) + " --strategy auto --memory-budget " +
                                                        std::to_string(static_cast<int64_t>(budget_mib * 1024)) + "KiB");
    ASSERT_EQ(run.exit_code, 0) << run.output;
    // The run's own table: the first row it did not mark over the budget is the one it marks chosen
    // and trains.
    const auto [rows, starred] = table_of(run.output);
    ASSERT_EQ(rows.size(), candidates.size()) << run.output;
    size_t first_fit = 0;
    while (first_fit < rows.size() && rows[first_fit].over_budget) ++first_fit;
    ASSERT_LT(first_fit, rows.size()) << run.output;
    EXPECT_EQ(starred, static_cast<int>(first_fit)) << run.output;
    EXPECT_LE(rows[first_fit].peak_mib, budget_mib + 0.05) << run.output;
    expected = rows[first_fit].name;
    const Planned& e = candidates.at(expected);
    EXPECT_NE(run.output.find("plan " + expected + ", 2 rank"), std::string::npos) << expected << "\n" << run.output;
    EXPECT_EQ(run.summary.at("tp"), e.tp) << expected;
    EXPECT_EQ(run.summary.at("pp"), e.pp) << expected;
    EXPECT_EQ((run.output.find("(sequence parallel)") != std::string::npos), e.sequence_parallel) << expected;
    // Design note [the global batch]: every plan the planner chooses trains 2 ranks x 8 a step.
    EXPECT_EQ(run.summary.at("global_batch"), 16) << expected;
    {
      SCOPED_TRACE(expected + " against one process");
      expect_same(run, single, 1e-5);
    }
    ASSERT_TRUE(run.summary.count("predicted_peak_mib")) << run.output;
    EXPECT_NEAR(run.summary.at("predicted_peak_mib"), rows[first_fit].peak_mib, 0.051) << expected;  // (the table's, 1 decimal)
    EXPECT_LE(run.summary.at("peak_tensor_mib"), budget_mib * 1.10) << expected;
    picked.insert(expected);
    std::printf("budget %.1f MiB (%s's need + 4%%): chose %s\n", budget_mib, name.c_str(), expected.c_str());
  }
  EXPECT_EQ(picked.size(), 4u);  // (the budgets really moved the choice)
  EXPECT_TRUE(picked.count(smallest)) << "the smallest need, " << smallest;
}

TEST(MemoryPlan, ABudgetNothingFitsNamesTheSmallestNeed) {
  const std::string metrics = temp_dir() + "/m.jsonl";
  auto res = run_command(bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-gpt") + kDemo +
                             " --strategy auto --memory-budget 4MiB --metrics " + metrics, 120);
  EXPECT_NE(res.exit_code, 0) << res.output;
  EXPECT_NE(res.output.find("--memory-budget 4.0 MiB per rank is too small: the smallest need is pp2+recompute at"),
            std::string::npos)
      << res.output;
  std::ifstream in(metrics);
  std::string line;
  EXPECT_FALSE(std::getline(in, line) && line.find("\"step\"") != std::string::npos) << "it trained: " << line;
}

TEST(MemoryPlan, PlanPrintsTheTableAndDoesNotTrain) {
  std::string output;
  const auto candidates = plan("dtrain-gpt", 2, std::string(kDemo) + " --memory-budget 40MiB", &output);
  ASSERT_EQ(candidates.size(), 11u);
  int chosen = 0;
  for (const auto& [name, p] : candidates) chosen += p.chosen;
  EXPECT_EQ(chosen, 1);
  EXPECT_TRUE(candidates.at("fsdp+recompute").chosen) << output;  // (the demo's activations need recomputation under 40 MiB)
  for (const char* row : {"ddp", "zero1", "zero2", "fsdp", "fsdp+recompute", "tp2+sp+recompute", "pp2+recompute", "(over budget)"}) {
    EXPECT_NE(output.find(row), std::string::npos) << row << "\n" << output;
  }
  EXPECT_EQ(output.find("step 1/"), std::string::npos) << output;
  EXPECT_EQ(output.find("done:"), std::string::npos) << output;
}

TEST(MemoryPlan, APlannedRunTrainsExactlyAsTheStrategyNamedByHand) {
  // The measurement's forward and backward (with dropout drawing from the default generator) leave
  // the random state, the buffers and the gradients as they were.
  const std::string args = std::string(kTinyModel) + " --steps 3 --dropout 0.1 --batch-size 4";
  const GptRun planned = run_program("dtrain-gpt", 2, args + " --strategy auto --memory-budget 1GiB");
  const GptRun named = run_program("dtrain-gpt", 2, args + " --strategy ddp");
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  ASSERT_EQ(named.exit_code, 0) << named.output;
  EXPECT_NE(planned.output.find("plan ddp, 2 rank"), std::string::npos) << planned.output;
  ASSERT_EQ(planned.steps.size(), 3u);
  for (size_t i = 0; i < planned.steps.size(); ++i) {
    EXPECT_EQ(planned.steps[i].at("loss"), named.steps[i].at("loss")) << "step " << i + 1;
  }
  EXPECT_EQ(planned.summary.at("param_checksum"), named.summary.at("param_checksum"));
  EXPECT_EQ(planned.summary.at("param_sq"), named.summary.at("param_sq"));
}

class PlannedLayout : public ::testing::TestWithParam<std::string> {};

TEST_P(PlannedLayout, TrainsExactlyAsTheLayoutNamedByHand) {
  // The TP layouts are built for measuring and dropped, the PP ones built and tried for two steps;
  // the chosen one is built afresh: with dropout (TP: the per-rank and shared streams) it trains as
  // the same layout named by hand.
  const std::string args = std::string(kDemo) + " --steps 3 --dropout 0.1";
  const auto candidates = plan("dtrain-gpt", 2, args);
  ASSERT_TRUE(candidates.count(GetParam()));
  const Planned& p = candidates.at(GetParam());
  for (const auto& [name, q] : candidates) {
    if (q.index < p.index) ASSERT_GT(q.predicted_mib, p.predicted_mib * 1.05) << name << " would be chosen first";
  }
  // (5% over: a measurement varies between runs by a reduction's buffer, e.g. 22.3 or 22.8 MiB)
  const GptRun planned = run_program("dtrain-gpt", 2, args + " --strategy auto --memory-budget " +
                                                          std::to_string(static_cast<int64_t>(p.predicted_mib * 1.05 * 1024)) + "KiB");
  const GptRun named = run_program("dtrain-gpt", 2, args + flags_of(p));
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  ASSERT_EQ(named.exit_code, 0) << named.output;
  EXPECT_EQ(planned.summary.at("tp"), p.tp);
  EXPECT_EQ(planned.summary.at("pp"), p.pp);
  const auto [rows, starred] = table_of(planned.output);
  ASSERT_GE(starred, 0) << planned.output;
  EXPECT_EQ(rows[starred].name, GetParam()) << planned.output;
  ASSERT_EQ(planned.steps.size(), 3u);
  for (size_t i = 0; i < planned.steps.size(); ++i) {
    EXPECT_EQ(planned.steps[i].at("loss"), named.steps[i].at("loss")) << "step " << i + 1;
  }
  EXPECT_EQ(planned.summary.at("param_checksum"), named.summary.at("param_checksum"));
  EXPECT_EQ(planned.summary.at("param_sq"), named.summary.at("param_sq"));
}

INSTANTIATE_TEST_SUITE_P(MemoryPlan, PlannedLayout, ::testing::Values("tp2+recompute", "pp2+recompute"),
                         [](const auto& info) { return info.param.substr(0, 3); });

TEST(MemoryPlan, LayoutsTheProgramCannotBuildAreListedWithTheReason) {
  std::string output;
  const auto candidates = plan("dtrain-gpt", 3, kDemo, &output);
  EXPECT_EQ(candidates.size(), 5u);
  EXPECT_NE(output.find("(not built: tp3: VocabParallelEmbedding: the vocabulary (256) does not divide"), std::string::npos)
      << output;
  EXPECT_NE(output.find("(not built: pp3: --microbatches 3 must divide the micro-batch of 8 samples"), std::string::npos)
      << output;
}

// ---- CUDA (GTEST_SKIP without it; one GPU: W = 1) ----
// On CUDA the planner counts the caching allocator's allocated bytes (torch.cuda.max_memory_allocated)
// and the run reports the same as peak_tensor_mib: each candidate within 10%, in fp32, under bf16
// autocast (its 16-bit copies of the weights are made in the measured forward), and when the model
// state dominates.
TEST(MemoryPlanCuda, EveryCandidatePredictsItsDevicePeakWithinTenPercent) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  expect_predictions_hold("dtrain-gpt", 1, std::string(kDemo) + " --device cuda", 2);
  expect_predictions_hold("dtrain-gpt", 1, std::string(kDemo) + " --device cuda --precision bf16", 2);
  expect_predictions_hold("dtrain-gpt", 1, std::string(kStateHeavy) + " --device cuda", 2);
}

// The default budget on CUDA is the device's memory (nvidia-smi's memory.total, where it exists),
// not the CPU's; a budget nothing fits is the same error as on the CPU.
TEST(MemoryPlanCuda, TheDefaultBudgetIsTheDevicesMemory) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  const double budget = default_budget_mib(1, " --device cuda");
  const auto smi = run_command("nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0", 30);
  if (smi.exit_code == 0 && !smi.output.empty()) {
    const double total = std::stod(smi.output);
    EXPECT_NEAR(budget, total, 0.01 * total);
  } else {
    EXPECT_GT(budget, 1024.0);  // (any GPU this runs on has more than 1 GiB)
  }
  auto res = run_command(bin("dtrun") + " --standalone --nproc-per-node 1 " + bin("dtrain-gpt") + kDemo +
                        " --device cuda --strategy auto --memory-budget 4MiB", 120);
  EXPECT_NE(res.exit_code, 0) << res.output;
  EXPECT_NE(res.output.find("--memory-budget 4.0 MiB per rank is too small: the smallest need is single+recompute at"),
            std::string::npos)
      << res.output;
}
