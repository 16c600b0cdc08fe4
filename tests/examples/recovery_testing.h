#pragma once
// What the in-process recovery tests check of a run (Design note [in-process recovery],
// dtrain/train/elastic.h): each step once with the uninterrupted run's loss, the final parameters,
// the regroups; and a random SIGKILL's environment.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "resume_testing.h"

namespace dtrain::testing::recovery {

using resume::GptRun;

inline bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Each step's last record: a roll-back of sharded state (Design note [sharded state in process])
// records the steps it redoes again; `redone` counts those records.
inline std::vector<resume::Fields> last_records(const GptRun& run, size_t& redone) {
  std::vector<resume::Fields> out;
  for (const auto& r : run.steps) {
    const auto step = static_cast<size_t>(r.at("step"));
    if (step <= out.size()) {
      redone += out.size() - step + 1;
      out.resize(step - 1);
    }
    out.push_back(r);
  }
  return out;
}

// The first step after each recovery: what the recovery moved (recovery_mib, its part across nodes).
inline std::vector<resume::Fields> recovery_records(const GptRun& run) {
  std::vector<resume::Fields> out;
  for (const auto& r : run.steps) {
    if (r.count("recovery_mib")) out.push_back(r);
  }
  return out;
}

// `run` regrouped `regroups` times on the way to `world_after` and trained as `full`, the
// uninterrupted run: each step once, the same losses and parameters, the global batch kept.
inline void expect_same_training(const GptRun& run, const GptRun& full, int world_after, size_t regroups) {
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(full.exit_code, 0) << full.output;
  size_t redone = 0;
  const auto steps = last_records(run, redone);
  ASSERT_EQ(steps.size(), full.steps.size()) << "each step once\n" << run.output;
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].at("step"), static_cast<double>(i + 1)) << run.output;
    EXPECT_NEAR(steps[i].at("loss"), full.steps[i].at("loss"), 1e-5 * full.steps[i].at("loss")) << "step " << i + 1;
  }
  double rolled_back = 0;  // (what the regroups said they redo: no step recorded again beyond it; fewer
  for (const auto& r : run.regroups) rolled_back += r.at("redone_steps");  // where a committed step's writer failed first)
  EXPECT_LE(static_cast<double>(redone), rolled_back) << run.output;
  const double sq = full.summary.at("param_sq");
  EXPECT_NEAR(run.summary.at("param_sq"), sq, 1e-5 * sq);
  EXPECT_NEAR(run.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-5 * sq);
  EXPECT_EQ(run.summary.at("world_size"), world_after);
  ASSERT_EQ(run.regroups.size(), regroups) << run.output;
  // (one per recovery; a retried one, or a recovery whose first step's writer was lost, counts once)
  const size_t moved = recovery_records(run).size();
  if (regroups > 0) EXPECT_TRUE(moved >= 1 && moved <= regroups) << moved << " steps say what a recovery moved\n" << run.output;
  for (const auto& r : run.regroups) {
    EXPECT_LT(r.at("recovery_s"), 5.0) << "the survivors waited for a timeout (60 s)\n" << run.output;
    EXPECT_EQ(r.at("global_batch"), full.start.at("global_batch"));  // the global batch kept
    EXPECT_GE(r.at("micro_batch") * r.at("accumulation") * r.at("world_size"), r.at("global_batch"));
  }
}

// `run` lost ranks on the way to `world_after` (dtrun says so); `full` is the uninterrupted run.
inline void expect_uninterrupted(const GptRun& run, const GptRun& full, int world_after, size_t regroups) {
  expect_same_training(run, full, world_after, regroups);
  EXPECT_TRUE(has(run.output, "go on (--keep-survivors)")) << run.output;
  EXPECT_TRUE(has(run.output, "the surviving workers exited 0 (lost on the way: rank(s) ")) << run.output;
}

// A random rank of `world` SIGKILLed at a random moment (0-25 ms in) of a random step in
// [first, last], each step slowed by 100 ms: the environment for resume::gpt, and the victim.
struct Kill {
  int victim = 0;
  std::string env;
};
inline Kill random_kill(std::mt19937& draw, int world, int first, int last) {
  Kill k;
  k.victim = std::uniform_int_distribution<int>(0, world - 1)(draw);
  const int step = std::uniform_int_distribution<int>(first, last)(draw);
  const int ms = std::uniform_int_distribution<int>(0, 25)(draw);
  k.env = "DTRAIN_TEST_SLOW_STEP_MS=100 DTRAIN_TEST_FAIL_AT_STEP=" + std::to_string(step) + " DTRAIN_TEST_FAIL_RANK=" +
          std::to_string(k.victim) + " DTRAIN_TEST_FAIL_AFTER_MS=" + std::to_string(ms) + " ";
  return k;
}

// The world size of each regroup, in order.
inline void expect_sizes(const GptRun& run, const std::vector<double>& sizes) {
  ASSERT_EQ(run.regroups.size(), sizes.size()) << run.output;
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(run.regroups[i].at("world_size"), sizes[i]) << "regroup " << i;
}

}  // namespace dtrain::testing::recovery
