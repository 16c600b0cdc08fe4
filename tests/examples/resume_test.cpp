// dtrain-gpt --save/--resume end to end, in real processes (dtrun for several ranks): a run saved
// after 3 steps and resumed to 6 equals the 6-step run bit for bit (same world size), or within
// 1e-5 when resumed at another world size or strategy; a rank killed under dtrun --max-restarts
// resumes from the last checkpoint and ends with the uninterrupted run's parameters; a checkpoint
// of another model or data order is an error naming what differs.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "testing/testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;

namespace {

using Fields = std::map<std::string, double>;  // the numeric fields of one metrics line

struct GptRun {
  int exit_code = -1;
  std::string output;
  std::vector<Fields> steps;  // one per step this process trained, in order
  Fields summary;             // the "final" line
};

Fields numeric_fields(const std::string& json_line) {
  static const std::regex field("\"([a-z_]+)\": (-?[0-9][0-9.eE+-]*)");
  Fields out;
  for (std::sregex_iterator it(json_line.begin(), json_line.end(), field), end; it != end; ++it) {
    out[(*it)[1]] = std::stod((*it)[2]);
  }
  return out;
}

const char* kTinyModel = " --layers 1 --d-model 32 --heads 2 --seq-len 32 --lr 3e-3 --threads 1";

// dtrain-gpt on `world` ranks (one plain process for world 1) with the tiny model and `args`;
// `env` prefixes the command (VAR=value ...), `dtrun_flags` go to dtrun.
GptRun gpt(int world, const std::string& args, const std::string& env = "", const std::string& dtrun_flags = "") {
  const std::string metrics = temp_dir() + "/metrics.jsonl";
  const std::string launch = world == 1 && dtrun_flags.empty()
                                 ? bin("dtrain-gpt")
                                 : bin("dtrun") + " --standalone --nproc-per-node " + std::to_string(world) +
                                       dtrun_flags + " " + bin("dtrain-gpt");
  auto res = run_command(env + launch + kTinyModel + args + " --metrics " + metrics, 120);
  GptRun run;
  run.exit_code = res.exit_code;
  run.output = res.output;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"final\": true") != std::string::npos) {
      run.summary = numeric_fields(line);
    } else {
      run.steps.push_back(numeric_fields(line));
    }
  }
  return run;
}

// `first` trained steps 1..k and saved, `rest` resumed and trained k+1..n: together they must be
// `full`'s n steps. tol 0: bit for bit; else relative.
void expect_continues(const GptRun& first, const GptRun& rest, const GptRun& full, double tol) {
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  ASSERT_EQ(full.exit_code, 0) << full.output;
  std::vector<Fields> joined = first.steps;
  joined.insert(joined.end(), rest.steps.begin(), rest.steps.end());
  ASSERT_EQ(joined.size(), full.steps.size());
  ASSERT_FALSE(rest.steps.empty());
  EXPECT_EQ(rest.summary.at("start_step"), static_cast<double>(first.steps.size()));
  for (size_t i = 0; i < joined.size(); ++i) {
    EXPECT_EQ(joined[i].at("step"), static_cast<double>(i + 1));
    const double a = joined[i].at("loss"), b = full.steps[i].at("loss");
    if (tol == 0) {
      EXPECT_EQ(a, b) << "step " << i + 1;
    } else {
      EXPECT_NEAR(a, b, tol * std::abs(b)) << "step " << i + 1;
    }
  }
  const double sq = full.summary.at("param_sq");
  if (tol == 0) {
    EXPECT_EQ(rest.summary.at("param_checksum"), full.summary.at("param_checksum"));
    EXPECT_EQ(rest.summary.at("param_sq"), sq);
  } else {
    EXPECT_NEAR(rest.summary.at("param_checksum"), full.summary.at("param_checksum"), tol * sq);
    EXPECT_NEAR(rest.summary.at("param_sq"), sq, tol * sq);
  }
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

class GptResumeBitExact : public ::testing::TestWithParam<std::string> {};

// A 6-step run that saves after steps 3 and 6 (--resume names a root without a checkpoint yet),
// and a run resumed from its step-3 checkpoint (--resume names that directory): steps 4-6 repeat
// the first run's bit for bit.
TEST_P(GptResumeBitExact, SavedAndResumedEqualsUninterrupted) {
  const std::string strategy = GetParam();
  const int W = strategy == "single" ? 1 : 2;
  const std::string args = " --strategy " + strategy + " --batch-size 2 --clip-grad-norm 0.5 --steps 6";
  const std::string ckpt = temp_dir() + "/ckpt";
  const GptRun full = gpt(W, args + " --save " + ckpt + " --save-every 3 --resume " + ckpt);
  EXPECT_TRUE(contains(full.output, "no checkpoint under " + ckpt + " yet: starting from step 0")) << full.output;
  EXPECT_EQ(full.summary.at("start_step"), 0);
  const GptRun rest = gpt(W, args + " --resume " + ckpt + "/step-00000003");
  EXPECT_TRUE(contains(rest.output, "resumed from " + ckpt + "/step-00000003: step 3")) << rest.output;
  GptRun first = full;
  first.steps.resize(3);
  expect_continues(first, rest, full, 0);
  EXPECT_TRUE(std::filesystem::exists(ckpt + "/step-00000006"));  // saved after the last step
}

INSTANTIATE_TEST_SUITE_P(Strategies, GptResumeBitExact, ::testing::Values("single", "ddp", "zero1", "zero2"),
                         [](const auto& info) { return info.param; });

// Saved at one world size (and strategy), resumed at another: the global batch stays 6 sequences,
// so the run continues the uninterrupted one-process run up to the reduction order (1e-5).
// zero1/zero2 saved at W=3 resume at W=2 (same strategy) and at W=1 (single); ddp saved at W=2
// resumes at W=3.
class GptResumeResharded : public ::testing::TestWithParam<std::string> {};

TEST_P(GptResumeResharded, ContinuesTheUninterruptedRun) {
  const std::string strategy = GetParam();
  const std::string ckpt = temp_dir() + "/ckpt";
  const std::string first3 = " --clip-grad-norm 0.5 --steps 3 --save " + ckpt;
  const std::string to6 = " --clip-grad-norm 0.5 --steps 6 --resume " + ckpt;
  const GptRun full = gpt(1, " --clip-grad-norm 0.5 --steps 6 --strategy single --batch-size 6");
  if (strategy == "ddp") {
    const GptRun first = gpt(2, first3 + " --strategy ddp --batch-size 3");
    expect_continues(first, gpt(3, to6 + " --strategy ddp --batch-size 2"), full, 1e-5);
    return;
  }
  const GptRun first = gpt(3, first3 + " --strategy " + strategy + " --batch-size 2");
  {
    SCOPED_TRACE("resumed at W=2");
    expect_continues(first, gpt(2, to6 + " --strategy " + strategy + " --batch-size 3"), full, 1e-5);
  }
  SCOPED_TRACE("resumed at W=1 (single)");
  expect_continues(first, gpt(1, to6 + " --strategy single --batch-size 6"), full, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Strategies, GptResumeResharded, ::testing::Values("zero1", "zero2", "ddp"),
                         [](const auto& info) { return info.param; });

// One rank kills itself at step 5 (after the checkpoint of step 4); dtrun restarts the group with
// the same command line, which resumes from step 4 and ends exactly where the uninterrupted run does.
TEST(GptResume, KilledRankRestartsFromTheLastCheckpoint) {
  const std::string args = " --strategy zero2 --batch-size 2 --steps 6";
  const std::string ckpt = temp_dir() + "/ckpt";
  const GptRun full = gpt(2, args);
  const GptRun crashed = gpt(2, args + " --save " + ckpt + " --save-every 2 --resume " + ckpt,
                          "DTRAIN_GPT_FAIL_AT_STEP=5 ", " --max-restarts 1");
  ASSERT_EQ(crashed.exit_code, 0) << crashed.output;
  EXPECT_TRUE(contains(crashed.output, "DTRAIN_GPT_FAIL_AT_STEP=5: killing myself")) << crashed.output;
  EXPECT_TRUE(contains(crashed.output, "restarting workers")) << crashed.output;
  EXPECT_TRUE(contains(crashed.output, "resumed from " + ckpt + "/step-00000004: step 4")) << crashed.output;
  // The restarted attempt rewrote the metrics: steps 5 and 6.
  ASSERT_EQ(crashed.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(crashed.steps[i].at("loss"), full.steps[4 + i].at("loss"));
  EXPECT_EQ(crashed.summary.at("start_step"), 4);
  EXPECT_EQ(crashed.summary.at("param_checksum"), full.summary.at("param_checksum"));
  EXPECT_EQ(crashed.summary.at("param_sq"), full.summary.at("param_sq"));
}

TEST(GptResume, MismatchedCheckpointIsAClearError) {
  const std::string ckpt = temp_dir() + "/ckpt";
  const std::string base = " --strategy single --batch-size 2 --steps 2";
  ASSERT_EQ(gpt(1, base + " --steps 1 --save " + ckpt).exit_code, 0);
  const std::pair<std::string, std::string> cases[] = {
      {" --d-model 48", "model/tok_emb.weight has shape [256, 32] in the checkpoint but the model's tok_emb.weight "
                        "has shape [256, 48]"},
      {" --optimizer sgd", "optim/kind is AdamW in the checkpoint but the optimizer is SGD"},
      {" --batch-size 3", "the checkpoint's data/global_batch is 2 but this run's global batch"},
      {" --seed 5", "the checkpoint's run/seed is 0 but this run's --seed is 5"},
  };
  for (const auto& [flags, message] : cases) {
    const GptRun run = gpt(1, base + flags + " --resume " + ckpt);
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_TRUE(contains(run.output, message)) << flags << "\n" << run.output;
  }
  const GptRun bad = gpt(1, base + " --save-every 2");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(contains(bad.output, "--save-every needs --save DIR")) << bad.output;
}
