// The whole matrix of issue 27: every data-parallel kind {single, ddp, zero1, zero2, fsdp, hsdp} x
// tensor degree {1, 2} x pipeline degree {1, 2}, on a user's model written without dtrain
// (dtrain-mlp), either trains equal to one process at the same global batch (fp32 AdamW, clipped:
// losses and parameter sums within 1e-5) or is refused by the plan's validation with its reason of
// method. The cells train one run in a chain: each trains 5 steps resumed from the checkpoint the
// cell before it saved (the first from scratch), so checkpoints move between cells of every kind
// and degree, and the chain's 110 steps are one process's 110 steps. (One launch per cell: a
// launch of W ranks costs W x 0.6 s of loading libtorch before any step; Design note [shared runs].)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../examples/resume_testing.h"

using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {

// 16 samples a step: each plan splits them into its data-parallel ranks x micro-batches of 2 x
// accumulation (Design note [the global batch]).
constexpr const char* kArgs =
    " --hidden 24 --depth 3 --samples 512 --global-batch-size 16 --batch-size 2 --lr 3e-3 --threads 1"
    " --clip-grad-norm 0.05";

struct Cell {
  std::string kind;
  int tp, pp;
  // hsdp: replicate 2 x shard 2 where the world allows (W <= 8), else replicate 2 x shard 1.
  int data_ranks() const { return kind == "single" ? 1 : kind == "hsdp" && tp * pp <= 2 ? 4 : 2; }
  int world() const { return data_ranks() * tp * pp; }
  bool refused() const { return kind == "zero2" && pp > 1; }
  std::string flags() const {
    std::string f = " --strategy " + kind;
    if (tp > 1) f += " --tp " + std::to_string(tp);
    if (pp > 1) f += " --pp " + std::to_string(pp);
    if (kind == "hsdp") f += " --shard-size " + std::to_string(data_ranks() / 2);
    return f;
  }
  std::string name() const { return kind + " x tp" + std::to_string(tp) + " x pp" + std::to_string(pp); }
};

std::vector<Cell> matrix() {
  std::vector<Cell> cells;
  for (const char* kind : {"single", "ddp", "zero1", "zero2", "fsdp", "hsdp"}) {
    for (int tp : {1, 2}) {
      for (int pp : {1, 2}) cells.push_back({kind, tp, pp});
    }
  }
  return cells;
}

GptRun mlp(int world, const std::string& args) { return run_program("dtrain-mlp", world, kArgs + args); }

// `run`'s steps are `full`'s steps [from, from + run.steps.size()) within 1e-5.
void expect_steps(const GptRun& run, const GptRun& full, size_t from, const std::string& what) {
  ASSERT_EQ(run.exit_code, 0) << what << "\n" << run.output;
  ASSERT_EQ(run.steps.size(), 5u) << what;  // (kStepsPerCell)
  double worst = 0;
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const double expected = full.steps[from + i].at("loss");
    EXPECT_NEAR(run.steps[i].at("loss"), expected, 1e-5 * expected) << what << ", step " << from + i + 1;
    worst = std::max(worst, std::abs(run.steps[i].at("loss") - expected) / expected);
  }
  std::printf("%-40s steps %zu-%zu: losses within %.1e of one process\n", what.c_str(), from + 1, from + run.steps.size(), worst);
}

}  // namespace

TEST(PlanMatrix, EveryCellTrainsLikeOneProcessOrIsRefusedForAReason) {
  constexpr int kStepsPerCell = 5;
  const std::vector<Cell> cells = matrix();
  const int64_t trained_cells = std::count_if(cells.begin(), cells.end(), [](const Cell& c) { return !c.refused(); });
  ASSERT_EQ(trained_cells, 22);
  const GptRun full = mlp(1, " --strategy single --steps " + std::to_string(kStepsPerCell * trained_cells));
  ASSERT_EQ(full.exit_code, 0) << full.output;
  ASSERT_EQ(full.steps.size(), static_cast<size_t>(kStepsPerCell * trained_cells));
  EXPECT_EQ(full.start.at("accumulation"), 8);
  const std::string root = temp_dir();
  std::string previous, previous_name;  // the checkpoint the next cell resumes from
  size_t done = 0;                      // steps trained by the chain so far
  for (const Cell& c : cells) {
    if (c.refused()) {
      if (c.world() > 4) continue;  // (the W = 8 cell: the same refusal as the W = 4 one, and plan_test's)
      const GptRun r = mlp(c.world(), c.flags() + " --steps 1");
      EXPECT_NE(r.exit_code, 0) << c.name();
      EXPECT_TRUE(contains(r.output, "sharding them saves nothing over zero1")) << c.name() << "\n" << r.output;
      continue;
    }
    const std::string what = c.name() + (previous.empty() ? " from scratch" : " resumed from " + previous_name);
    const std::string dir = root + "/" + std::to_string(done);
    const GptRun run = mlp(c.world(), c.flags() + " --steps " + std::to_string(done + kStepsPerCell) + " --save " + dir +
                                          (previous.empty() ? "" : " --resume " + previous));
    expect_steps(run, full, done, what);
    if (run.exit_code != 0) return;  // (the chain is broken: the next cells would say nothing new)
    EXPECT_EQ(run.start.at("global_batch"), 16) << c.name();
    EXPECT_EQ(run.start.at("accumulation"), 16 / (2 * c.data_ranks())) << c.name();
    EXPECT_EQ(run.summary.at("start_step"), static_cast<double>(done)) << what;
    done += kStepsPerCell;
    previous = dir;
    previous_name = c.name();
    if (done == full.steps.size()) {
      const double sq = full.summary.at("param_sq");
      EXPECT_NEAR(run.summary.at("param_sq"), sq, 1e-5 * sq) << what;
      EXPECT_NEAR(run.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-5 * sq) << what;
    }
  }
  EXPECT_EQ(done, full.steps.size());
}
