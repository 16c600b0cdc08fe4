// Evaluation on held-out samples in the library loop (Design note [evaluation],
// src/train/evaluate.cpp): the validation loss of every plan is one process's (W = 1, 2, 3, TP,
// PP, TP inside ZeRO, FSDP around pipeline stages); evaluating changes nothing of the training (bit for bit, with dropout, also
// under TP); --eval-only evaluates a checkpoint of any plan under any other; bad requests are
// clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {

// 512 samples, the last 128 held out; 3 global batches of 12 (36 samples) evaluated.
constexpr const char* kHeldOut =
    " --hidden 24 --depth 2 --samples 512 --steps 8 --lr 3e-3 --threads 1 --global-batch-size 12 --batch-size 2"
    " --val-fraction 0.25 --eval-batches 3";

GptRun mlp(int world, const std::string& args) { return run_program("dtrain-mlp", world, kHeldOut + args); }

// Each step's val_loss where it has one (step number -> loss).
std::vector<std::pair<int, double>> val_losses(const GptRun& r) {
  std::vector<std::pair<int, double>> out;
  for (const auto& s : r.steps) {
    if (s.count("val_loss")) out.emplace_back(static_cast<int>(s.at("step")), s.at("val_loss"));
  }
  return out;
}

}  // namespace

TEST(Evaluation, EqualsOneProcessUnderEveryPlan) {
  const GptRun single = mlp(1, " --strategy single --eval-every 4");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  const auto reference = val_losses(single);
  ASSERT_EQ(reference.size(), 2u) << single.output;
  EXPECT_EQ(reference[0].first, 4);
  EXPECT_EQ(reference[1].first, 8);
  EXPECT_NE(reference[0].second, reference[1].second);  // (the model changed between them)
  EXPECT_EQ(single.summary.at("val_loss"), reference[1].second);
  EXPECT_EQ(single.summary.at("eval_samples"), 36);
  EXPECT_TRUE(contains(single.output, "dtrain-mlp: step 4: validation loss ")) << single.output;
  const std::pair<int, const char*> plans[] = {{2, " --strategy ddp"},          {3, " --strategy fsdp"},
                                               {3, " --strategy zero2"},        {2, " --strategy single --tp 2"},
                                               {2, " --strategy single --pp 2"}, {4, " --strategy zero1 --tp 2"},
                                               {4, " --strategy fsdp --pp 2"}};
  for (const auto& [world, flags] : plans) {
    SCOPED_TRACE(std::to_string(world) + flags);
    const GptRun r = mlp(world, std::string(flags) + " --eval-every 4");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ASSERT_EQ(r.steps.size(), single.steps.size());
    for (size_t i = 0; i < r.steps.size(); ++i) {
      EXPECT_NEAR(r.steps[i].at("loss"), single.steps[i].at("loss"), 1e-5 * single.steps[i].at("loss")) << "step " << i + 1;
    }
    const auto got = val_losses(r);
    ASSERT_EQ(got.size(), reference.size()) << r.output;
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].first, reference[i].first);
      EXPECT_NEAR(got[i].second, reference[i].second, 1e-5 * reference[i].second) << "step " << got[i].first;
    }
  }
}

// The GPT with dropout: evaluating every 2 steps leaves every step of the training as it was (the
// random streams, the data position), in one process and with TP's shared streams.
TEST(Evaluation, LeavesTheTrainingAsItWas) {
  const std::string args = " --steps 4 --dropout 0.1 --batch-size 4 --val-fraction 0.1";
  for (const auto& [world, flags] : std::vector<std::pair<int, std::string>>{{1, " --strategy single"}, {2, " --strategy single --tp 2"}}) {
    SCOPED_TRACE(flags);
    const GptRun plain = gpt(world, args + flags);
    const GptRun evaluated = gpt(world, args + flags + " --eval-every 2 --eval-batches 4");
    ASSERT_EQ(plain.exit_code, 0) << plain.output;
    ASSERT_EQ(evaluated.exit_code, 0) << evaluated.output;
    ASSERT_EQ(val_losses(evaluated).size(), 2u) << evaluated.output;
    ASSERT_EQ(plain.steps.size(), evaluated.steps.size());
    for (size_t i = 0; i < plain.steps.size(); ++i) EXPECT_EQ(plain.steps[i].at("loss"), evaluated.steps[i].at("loss")) << i + 1;
    EXPECT_EQ(plain.summary.at("param_checksum"), evaluated.summary.at("param_checksum"));
    EXPECT_EQ(plain.summary.at("param_sq"), evaluated.summary.at("param_sq"));
  }
}

TEST(Evaluation, EvalOnlyEvaluatesACheckpointOfAnyPlan) {
  const std::string ckpt = temp_dir() + "/ck";
  const GptRun trained = mlp(2, " --strategy fsdp --eval-every 8 --save " + ckpt);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const double expected = trained.summary.at("val_loss");
  for (const auto& [world, flags] : std::vector<std::pair<int, std::string>>{
           {1, " --strategy single"}, {3, " --strategy zero2"}, {2, " --strategy single --tp 2"}, {2, " --strategy single --pp 2"}}) {
    SCOPED_TRACE(flags);
    const GptRun r = mlp(world, flags + " --eval-only --resume " + ckpt);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(r.steps.empty()) << r.output;  // (nothing trained)
    EXPECT_NEAR(r.summary.at("val_loss"), expected, 1e-5 * expected);
    EXPECT_NEAR(r.summary.at("param_checksum"), trained.summary.at("param_checksum"), 1e-9 * trained.summary.at("param_sq"));
    EXPECT_TRUE(contains(r.output, "validation loss ")) << r.output;
    EXPECT_TRUE(contains(r.output, " over 36 held-out samples at step 8")) << r.output;
  }
}

TEST(Evaluation, BadRequestsAreClearErrors) {
  const std::pair<const char*, const char*> bad[] = {
      {" --eval-every 2 --val-fraction 0", "--eval-every needs held-out samples: --val-fraction F"},
      {" --eval-only", "--eval-only evaluates a checkpoint: give --resume DIR"},
      {" --eval-batches 2 --val-fraction 0.1", "--eval-batches applies to --eval-every N or --eval-only"},
      {" --val-fraction 1.5", "--val-fraction expects a number in [0, 1)"},
  };
  for (const auto& [args, says] : bad) {
    const auto r = run_command(bin("dtrain-mlp") + " --hidden 8 --steps 2" + args, 30);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, says)) << args << "\n" << r.output;
  }
  // Found when the run starts: no path for a program without files; too few held-out samples.
  const std::pair<const char*, const char*> at_start[] = {
      {" --val-data /tmp --eval-every 2", "--val-data: dtrain-mlp reads no held-out samples from a path; hold out"},
      {" --samples 512 --batch-size 16 --val-fraction 0.02 --eval-every 2",
       "the held-out samples (10) are fewer than one global batch (16)"},
  };
  for (const auto& [args, says] : at_start) {
    const auto r = run_command(bin("dtrain-mlp") + " --hidden 8 --steps 2 --threads 1" + args, 30);
    EXPECT_NE(r.exit_code, 0) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, says)) << args << "\n" << r.output;
  }
  const auto r = run_command(bin("dtrain-gpt") + kTinyModel + " --steps 1 --eval-every 1 --val-data /nonexistent/val.txt", 30);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.output, "/nonexistent/val.txt")) << r.output;
}
