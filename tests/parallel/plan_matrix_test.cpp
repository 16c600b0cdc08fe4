// The whole matrix of issue 27: every data-parallel kind {single, ddp, zero1, zero2, fsdp, hsdp} x
// tensor degree {1, 2} x pipeline degree {1, 2}, on a user's model written without dtrain
// (dtrain-mlp), either trains equal to one process at the same global batch (10 AdamW steps,
// fp32, clipped: losses and parameter sums within 1e-5) or is refused by the plan's validation
// with its reason of method. Each cell trains steps 1-5 from scratch and saves; then steps 6-10
// resumed from the checkpoint of the cell before it (the last cell's for the first): checkpoints
// move between cells of every kind and degree.
#include <gtest/gtest.h>

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
  ASSERT_EQ(run.steps.size(), 5u) << what;
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const double expected = full.steps[from + i].at("loss");
    EXPECT_NEAR(run.steps[i].at("loss"), expected, 1e-5 * expected) << what << ", step " << from + i + 1;
  }
}

}  // namespace

TEST(PlanMatrix, EveryCellTrainsLikeOneProcessOrIsRefusedForAReason) {
  const GptRun full = mlp(1, " --strategy single --steps 10");
  ASSERT_EQ(full.exit_code, 0) << full.output;
  ASSERT_EQ(full.steps.size(), 10u);
  EXPECT_EQ(full.start.at("accumulation"), 8);
  const std::string root = temp_dir();
  std::vector<Cell> trained;
  for (const Cell& c : matrix()) {
    if (c.refused()) {
      const GptRun r = mlp(c.world(), c.flags() + " --steps 1");
      EXPECT_NE(r.exit_code, 0) << c.name();
      EXPECT_TRUE(contains(r.output, "sharding them saves nothing over zero1")) << c.name() << "\n" << r.output;
      continue;
    }
    const std::string dir = root + "/" + std::to_string(trained.size());
    const GptRun first = mlp(c.world(), c.flags() + " --steps 5 --save " + dir);
    expect_steps(first, full, 0, c.name() + " (steps 1-5)");
    EXPECT_EQ(first.start.at("global_batch"), 16) << c.name();
    EXPECT_EQ(first.start.at("accumulation"), 16 / (2 * c.data_ranks())) << c.name();
    trained.push_back(c);
  }
  ASSERT_EQ(trained.size(), 22u);
  for (size_t k = 0; k < trained.size(); ++k) {
    const Cell& c = trained[k];
    const size_t from = (k + trained.size() - 1) % trained.size();
    const std::string what = c.name() + " resumed from " + trained[from].name();
    const GptRun rest = mlp(c.world(), c.flags() + " --steps 10 --resume " + root + "/" + std::to_string(from));
    expect_steps(rest, full, 5, what + " (steps 6-10)");
    if (rest.exit_code != 0) continue;
    EXPECT_EQ(rest.summary.at("start_step"), 5) << what;
    const double sq = full.summary.at("param_sq");
    EXPECT_NEAR(rest.summary.at("param_sq"), sq, 1e-5 * sq) << what;
    EXPECT_NEAR(rest.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-5 * sq) << what;
  }
}
