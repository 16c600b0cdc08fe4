// dtrain-gpt --save/--resume end to end, in real processes (dtrun for several ranks): a run saved
// after 3 steps and resumed to 6 equals the 6-step run bit for bit (same world size), or within
// 1e-5 when resumed at another world size or strategy; a rank killed under dtrun --max-restarts
// resumes from the last checkpoint and ends with the uninterrupted run's parameters; a checkpoint
// of another model or data order is an error naming what differs.
#include <gtest/gtest.h>


#include "resume_testing.h"

#include "dtrain/util/fs.h"

using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

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
  EXPECT_TRUE(dtrain::util::fs::exists(ckpt + "/step-00000006"));  // saved after the last step
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
                          "DTRAIN_TEST_FAIL_AT_STEP=5 ", " --max-restarts 1");
  expect_restarted_from_step_4(crashed, full, ckpt);
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

// --loss-scale dynamic: the loss scaler's state (scale, growth tracker) and the count of skipped
// steps are part of the checkpoint. An inf gradient at step 1 (test hook) halves the scale; with a
// growth interval of 3 it doubles after step 4 only if the resumed run restored both the scale
// (32768) and the tracker (2 good steps), and the resumed run is bit-exact.
class GptResumeLossScaler : public ::testing::TestWithParam<std::string> {};

TEST_P(GptResumeLossScaler, ScalerStateResumesBitExact) {
  const std::string strategy = GetParam();
  const int W = strategy == "single" ? 1 : 2;
  const std::string args = " --strategy " + strategy +
                           " --batch-size 2 --clip-grad-norm 0.5 --steps 6 --loss-scale dynamic"
                           " --loss-scale-growth-interval 3";
  const std::string ckpt = temp_dir() + "/ckpt";
  const GptRun full = gpt(W, args + " --save " + ckpt + " --save-every 3", "DTRAIN_TEST_INF_GRAD_AT_STEP=1 ");
  const GptRun rest = gpt(W, args + " --resume " + ckpt + "/step-00000003");
  GptRun first = full;
  first.steps.resize(3);
  expect_continues(first, rest, full, 0);
  const std::vector<double> scales = {65536, 32768, 32768, 32768, 65536, 65536};
  ASSERT_EQ(full.steps.size(), scales.size());
  for (size_t i = 0; i < scales.size(); ++i) EXPECT_EQ(full.steps[i].at("loss_scale"), scales[i]) << "step " << i + 1;
  EXPECT_EQ(full.steps[0].at("skipped"), 1);
  ASSERT_EQ(rest.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(rest.steps[i].at("loss_scale"), scales[3 + i]) << "step " << i + 4;
    EXPECT_EQ(rest.steps[i].at("skipped"), 0) << "step " << i + 4;
  }
  EXPECT_EQ(rest.summary.at("skipped_steps"), 1);  // carried over from the checkpoint
  EXPECT_EQ(rest.summary.at("loss_scale"), 65536);
}

INSTANTIATE_TEST_SUITE_P(Strategies, GptResumeLossScaler, ::testing::Values("single", "ddp", "zero1", "zero2", "fsdp"),
                         [](const auto& info) { return info.param; });

// Turning loss scaling on or off at a resume: a checkpoint without scaler state starts the scaler
// at its initial scale (and says so); a run without scaling ignores a checkpoint's scaler state.
// In fp32 the scale changes nothing, so both continue the uninterrupted run bit for bit.
TEST(GptResume, LossScalingOnOrOffAtResume) {
  const std::string args = " --strategy ddp --batch-size 2 --steps 4";
  const GptRun full = gpt(2, args);
  for (const std::string saved_with : {"none", "dynamic"}) {
    SCOPED_TRACE("saved with --loss-scale " + saved_with);
    const std::string resumed_with = saved_with == "none" ? "dynamic" : "none";
    const std::string ckpt = temp_dir() + "/ckpt-" + saved_with;
    const GptRun first = gpt(2, args + " --steps 2 --loss-scale " + saved_with + " --save " + ckpt);
    const GptRun rest = gpt(2, args + " --loss-scale " + resumed_with + " --resume " + ckpt);
    expect_continues(first, rest, full, 0);
    EXPECT_EQ(contains(rest.output, "the checkpoint has no loss-scaler state (saved with --loss-scale none): starting "
                                    "from scale 65536"),
              saved_with == "none")
        << rest.output;
  }
}
