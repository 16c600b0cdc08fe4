// dtrain-gpt's loss scaling and device flags in training runs (real processes through dtrun):
// - --loss-scale dynamic runs the whole GradScaler path on the CPU (fp32, bf16): with a power-of-two
//   scale it trains like no scaling, for ddp and the sharded strategies at W = 1, 2, 3;
// - an inf written into one rank's gradient (DTRAIN_TEST_INF_GRAD_AT_STEP) makes every rank skip
//   that step and halve the scale: the run equals a one-process run that skips the same step;
// - --cpu-offload is a no-op on the CPU;
// - on CUDA (skipped without it; run on one H100, W = 1): every strategy equals one
//   process, fp16 with dynamic scaling and bf16 track fp32 within a few %, fsdp fp16 and
//   --cpu-offload match fsdp fp32, and a checkpoint resumes.
// The flags' errors are in gpt_device_test.cpp; resume with a loss scaler in resume_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <torch/cuda.h>

#include "resume_testing.h"

using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {

const std::string kDtrunAlways = " --max-restarts 0";  // makes gpt() use dtrun at W = 1 too
const int kSteps = 8;

// `run` trained like `ref`: every step's loss (and grad_norm where clipped) and the final
// parameter sums within `tol` relative. tol 0: bit for bit.
void expect_tracks(const GptRun& run, const GptRun& ref, double tol) {
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(run.steps.size(), ref.steps.size());
  ASSERT_FALSE(ref.steps.empty());
  auto near = [tol](double a, double b, double scale) {
    return tol == 0 ? a == b : std::abs(a - b) <= tol * std::abs(scale);
  };
  for (size_t i = 0; i < ref.steps.size(); ++i) {
    const double a = run.steps[i].at("loss"), b = ref.steps[i].at("loss");
    EXPECT_TRUE(near(a, b, b)) << "step " << i + 1 << ": loss " << a << " vs " << b;
    ASSERT_EQ(run.steps[i].count("grad_norm"), ref.steps[i].count("grad_norm")) << "step " << i + 1;
    if (ref.steps[i].count("grad_norm")) {
      const double ga = run.steps[i].at("grad_norm"), gb = ref.steps[i].at("grad_norm");
      EXPECT_TRUE(near(ga, gb, gb)) << "step " << i + 1 << ": grad_norm " << ga << " vs " << gb;
    }
  }
  const double sq = ref.summary.at("param_sq");
  EXPECT_TRUE(near(run.summary.at("param_sq"), sq, sq)) << run.summary.at("param_sq") << " vs " << sq;
  EXPECT_TRUE(near(run.summary.at("param_checksum"), ref.summary.at("param_checksum"), sq))
      << run.summary.at("param_checksum") << " vs " << ref.summary.at("param_checksum");
  EXPECT_GT(run.steps.front().at("loss"), run.steps.back().at("loss"));  // it learns
}

// Losses within `rel` of the reference's at every step (lower precision), and it learns.
void expect_close_losses(const GptRun& run, const GptRun& ref, double rel) {
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ASSERT_EQ(run.steps.size(), ref.steps.size());
  for (size_t i = 0; i < ref.steps.size(); ++i) {
    EXPECT_NEAR(run.steps[i].at("loss"), ref.steps[i].at("loss"), rel * ref.steps[i].at("loss")) << "step " << i + 1;
  }
  EXPECT_GT(run.steps.front().at("loss"), run.steps.back().at("loss"));
}

// The per-step loss_scale and skipped fields, and the summary's, of a --loss-scale dynamic run.
void expect_scale_history(const GptRun& run, const std::vector<double>& scales, const std::vector<int>& skipped_at) {
  ASSERT_EQ(run.steps.size(), scales.size()) << run.output;
  for (size_t i = 0; i < scales.size(); ++i) {
    const int step = static_cast<int>(i + 1);
    const bool skipped = std::find(skipped_at.begin(), skipped_at.end(), step) != skipped_at.end();
    EXPECT_EQ(run.steps[i].at("loss_scale"), scales[i]) << "step " << step;
    EXPECT_EQ(run.steps[i].at("skipped"), skipped ? 1 : 0) << "step " << step;
  }
  EXPECT_EQ(run.summary.at("skipped_steps"), static_cast<double>(skipped_at.size()));
}

}  // namespace

// (strategy, world size)
class GptLossScaling : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  std::string strategy() const { return std::get<0>(GetParam()); }
  int world() const { return std::get<1>(GetParam()); }
  std::string args() const {
    return " --strategy " + strategy() + " --batch-size 2 --clip-grad-norm 0.5 --steps " + std::to_string(kSteps);
  }
};

// One test per (strategy, world) sharing its runs (Design note [shared runs]):
// - a power-of-two scale is exact in fp32: scaling, unscaling the gradients this rank holds and
//   clipping them afterwards trains like no scaling (the scale growing every 3 steps);
// - +inf in one gradient element of the last rank at step 3: every rank skips step 3 (so the run
//   equals one process skipping it) and the scale halves; the growth interval doubles it again.
TEST_P(GptLossScaling, TrainsLikeNoScaleAndAnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  const std::string dynamic = " --loss-scale dynamic --loss-scale-growth-interval 3";
  const GptRun none = gpt(world(), args(), "", kDtrunAlways);
  const GptRun clean = gpt(world(), args() + dynamic, "", kDtrunAlways);
  {
    SCOPED_TRACE("dynamic scaling against none");
    ASSERT_NO_FATAL_FAILURE(expect_tracks(clean, none, 1e-6));  // a failed run stops here, not in front()
    expect_scale_history(clean, {65536, 65536, 65536, 131072, 131072, 131072, 262144, 262144}, {});
    EXPECT_EQ(none.steps.front().count("loss_scale"), 0u);  // no scaler, no scaler fields
  }
  const std::string hook = "DTRAIN_TEST_INF_GRAD_AT_STEP=3 ";
  const GptRun hooked = gpt(world(), args() + dynamic, hook, kDtrunAlways);
  ASSERT_EQ(hooked.exit_code, 0) << hooked.output;
  EXPECT_TRUE(contains(hooked.output, "[rank " + std::to_string(world() - 1) + "]: DTRAIN_TEST_INF_GRAD_AT_STEP=3: +inf"))
      << hooked.output;
  EXPECT_TRUE(contains(hooked.output, "step 3: inf/NaN in the gradients: skipped on every rank, loss scale 65536 -> "
                                      "32768")) << hooked.output;
  // Growth after 3 good steps in a row: steps 1 and 2 are not enough, the skip halves the scale
  // and starts the count again, steps 4, 5 and 6 double it.
  expect_scale_history(hooked, {65536, 65536, 65536, 32768, 32768, 32768, 65536, 65536}, {3});
  EXPECT_EQ(hooked.summary.at("loss_scale"), 65536);
  const GptRun single = gpt(1, " --strategy single --batch-size " + std::to_string(2 * world()) +
                                   " --clip-grad-norm 0.5 --steps " + std::to_string(kSteps) + dynamic, hook);
  ASSERT_EQ(single.steps.size(), hooked.steps.size());
  // Step 3 has no grad_norm on either side (no clipping of an inf gradient); compare the rest.
  expect_tracks(hooked, single, 1e-5);
  // The skip is real: from step 4 on the run differs from the one without the hook.
  EXPECT_EQ(hooked.steps[2].at("loss"), clean.steps[2].at("loss"));
  EXPECT_NE(hooked.steps[3].at("loss"), clean.steps[3].at("loss"));
  EXPECT_EQ(hooked.steps[2].count("grad_norm"), 0u);
  EXPECT_EQ(clean.steps[2].count("grad_norm"), 1u);
}

INSTANTIATE_TEST_SUITE_P(StrategiesAndWorlds, GptLossScaling,
                         ::testing::Combine(::testing::Values("ddp", "zero2", "fsdp"), ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_W" + std::to_string(std::get<1>(info.param));
                         });

// bf16 autocast with a dynamic scale trains like bf16 without (powers of two are exact in bf16 too).
TEST(GptLossScalingBf16, DynamicScaleTrainsLikeNoScale) {
  const std::string args = " --strategy zero1 --precision bf16 --batch-size 2 --steps " + std::to_string(kSteps);
  expect_tracks(gpt(2, args + " --loss-scale dynamic"), gpt(2, args), 1e-6);
}

// On the CPU, --cpu-offload changes nothing (the shards are on the CPU already).
TEST(GptCpuOffload, IsANoOpOnTheCpu) {
  for (const std::string strategy : {"fsdp", "hsdp"}) {
    SCOPED_TRACE(strategy);
    const std::string args = " --strategy " + strategy + " --layers 2 --batch-size 2 --steps 4";
    expect_tracks(gpt(2, args + " --cpu-offload"), gpt(2, args), 0);
  }
}

// ---- CUDA (GTEST_SKIP without it; passed on one H100 at W = 1, pip torch 2.11+cu130) ----

namespace {

// Ranks for the CUDA runs: one GPU each, at most 2.
int cuda_world() { return static_cast<int>(std::min<int64_t>(2, torch::cuda::device_count())); }

}  // namespace

// Every strategy on CUDA equals one CUDA process with the global batch (tolerance 10x the CPU
// tests': reductions in another order, never calibrated on a GPU).
TEST(GptCuda, EveryStrategyEqualsOneProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  const int W = cuda_world();
  const std::string steps = " --device cuda --clip-grad-norm 0.5 --steps " + std::to_string(kSteps);
  const GptRun single = gpt(1, steps + " --strategy single --batch-size " + std::to_string(2 * W));
  for (const std::string strategy : {"ddp", "zero1", "zero2", "fsdp", "hsdp"}) {
    SCOPED_TRACE(strategy);
    expect_tracks(gpt(W, steps + " --strategy " + strategy + " --batch-size 2", "", kDtrunAlways), single, 1e-4);
  }
}

// Every plan's multi-rank CUDA path on one GPU: ranks sharing it over gloo (Design note [ranks
// sharing a GPU], train/session.cpp; NCCL refuses two ranks on one device) train like one CUDA
// process with the global batch, W = 2 and 3 (uneven shards), data-parallel kinds, --tp and --pp.
TEST(GptCuda, RanksSharingOneGpuOverGlooEqualOneProcess) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  const std::string steps = " --device cuda --backend gloo --layers 2 --clip-grad-norm 0.5 --batch-size 2"
                            " --global-batch-size 12 --steps " + std::to_string(kSteps);
  const GptRun single = gpt(1, steps + " --strategy single");
  const std::vector<std::pair<int, std::string>> runs = {
      {2, "--strategy ddp"},  {2, "--strategy zero1"}, {2, "--strategy zero2"}, {2, "--strategy fsdp"},
      {2, "--strategy hsdp"}, {2, "--tp 2"},            {2, "--pp 2"},           {3, "--strategy zero2"},
      {3, "--strategy fsdp"}};
  for (const auto& [world, plan] : runs) {
    SCOPED_TRACE("W = " + std::to_string(world) + ", " + plan);
    const GptRun run = gpt(world, steps + " " + plan, "", kDtrunAlways);
    if (world > torch::cuda::device_count()) EXPECT_TRUE(contains(run.output, "local ranks share")) << run.output;
    expect_tracks(run, single, 1e-4);
  }
}

// --strategy dp (DataParallel: one process, the batch scattered over every GPU) equals one GPU.
TEST(GptCuda, DataParallelEqualsOneGpu) {
  if (torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs in one process";
  const std::string steps = " --device cuda --clip-grad-norm 0.5 --batch-size 4 --steps " + std::to_string(kSteps);
  expect_tracks(gpt(1, steps + " --strategy dp"), gpt(1, steps + " --strategy single"), 1e-4);
}

// fp16 autocast with dynamic loss scaling (its default) and bf16 track fp32 within a few %.
TEST(GptCuda, Fp16WithDynamicScalingAndBf16TrackFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  const int W = cuda_world();
  const std::string args = " --device cuda --strategy ddp --batch-size 2 --steps " + std::to_string(kSteps);
  const GptRun fp32 = gpt(W, args, "", kDtrunAlways);
  const GptRun fp16 = gpt(W, args + " --precision fp16", "", kDtrunAlways);
  expect_close_losses(fp16, fp32, 0.03);
  ASSERT_EQ(fp16.steps.size(), static_cast<size_t>(kSteps));
  EXPECT_GT(fp16.steps.front().at("loss_scale"), 0);  // the scaler ran (dynamic is fp16's default)
  EXPECT_LT(fp16.summary.at("skipped_steps"), kSteps / 2);
  expect_close_losses(gpt(W, args + " --precision bf16", "", kDtrunAlways), fp32, 0.03);
}

// FSDP on CUDA: fp16 (fp16 parameters, fp32 reduction, dynamic scaling of the shards) tracks fp32
// within a few %; --cpu-offload (shards and AdamW on the CPU) matches fp32 closely, with fp16 too.
TEST(GptCuda, FsdpFp16AndCpuOffloadMatchFsdpFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  const int W = cuda_world();
  const std::string args = " --device cuda --strategy fsdp --layers 2 --batch-size 2 --clip-grad-norm 0.5 --steps " +
                           std::to_string(kSteps);
  const GptRun fp32 = gpt(W, args, "", kDtrunAlways);
  expect_close_losses(gpt(W, args + " --precision fp16", "", kDtrunAlways), fp32, 0.03);
  expect_tracks(gpt(W, args + " --cpu-offload", "", kDtrunAlways), fp32, 1e-4);
  expect_close_losses(gpt(W, args + " --precision fp16 --cpu-offload", "", kDtrunAlways), fp32, 0.03);
}

// A CUDA run saved after 3 steps and resumed (loss scaler included) continues the uninterrupted
// run (within 1e-5: CUDA's embedding backward adds with atomics, in no fixed order).
TEST(GptCuda, Fp16ResumeContinuesTheRun) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "needs CUDA";
  const int W = cuda_world();
  const std::string ckpt = temp_dir() + "/ckpt";
  const std::string args = " --device cuda --precision fp16 --strategy zero2 --batch-size 2 --steps 6";
  const GptRun full = gpt(W, args + " --save " + ckpt + " --save-every 3", "", kDtrunAlways);
  const GptRun rest = gpt(W, args + " --resume " + ckpt + "/step-00000003", "", kDtrunAlways);
  GptRun first = full;
  first.steps.resize(3);
  expect_continues(first, rest, full, 1e-5);
  ASSERT_EQ(rest.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.steps[i].at("loss_scale"), full.steps[3 + i].at("loss_scale"));
}
