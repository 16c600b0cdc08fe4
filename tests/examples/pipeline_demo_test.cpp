// --pp in the library loop, in real processes under dtrun: dtrain-gpt (cut by layer counts) and
// dtrain-mlp (a user's model cut by its own hooks.stages) train like one process on the same global
// batch for every schedule, with data parallelism around the stages, clipping and loss scaling;
// checkpoints move between pipelined and plain runs; bad layouts and a killed rank end clearly.
#include <gtest/gtest.h>

#include "examples/resume_testing.h"
#include "testing/testing.h"

using namespace dtrain::testing;
using namespace dtrain::testing::resume;

namespace {

const char* kGpt = " --layers 5 --steps 10";

}  // namespace

// Every schedule at PP 2, 3 and 4 (5 layers: never divisible), interleaved with V = 2, fewer
// micro-batches than stages, recomputation inside the stages: the same losses and parameters as
// one process (AdamW, fp32).
TEST(PipelineDemo, GptEveryScheduleEqualsOneProcess) {
  const GptRun single = gpt(1, std::string(kGpt) + " --strategy single --batch-size 8");
  struct Run {
    int world;
    std::string flags;
  };
  for (const Run& r : {Run{2, "--pp 2 --schedule gpipe --microbatches 4"}, Run{3, "--pp 3 --microbatches 4"},
                       Run{4, "--pp 4 --microbatches 2"}, Run{2, "--pp 2 --virtual-stages 2 --microbatches 4"},
                       Run{2, "--pp 2 --microbatches 2 --activation-checkpointing"}}) {
    SCOPED_TRACE(r.flags);
    const GptRun pp = gpt(r.world, std::string(kGpt) + " --strategy single --batch-size 8 --global-batch-size 8 " + r.flags);
    expect_same(pp, single, 1e-5);
    EXPECT_TRUE(contains(pp.output, " x pipeline ")) << pp.output;
  }
}

// PP2 x DDP2, PP2 x ZeRO-1 and PP2 x FSDP2 at W = 4 with clipping (global norm over both stages)
// and a dynamic loss scale that skips a step on every rank (inf planted in one rank's gradients at
// step 3).
TEST(PipelineDemo, GptWithDataParallelClippingAndLossScaling) {
  const std::string common = std::string(kGpt) + " --clip-grad-norm 0.5 --loss-scale dynamic";
  const std::string inf = "DTRAIN_TEST_INF_GRAD_AT_STEP=3 ";
  const GptRun single = gpt(1, common + " --strategy single --batch-size 8", inf);
  for (const std::string around : {"ddp", "zero1", "fsdp"}) {
    SCOPED_TRACE("pp 2 x " + around + " 2");
    const GptRun pp = gpt(4, common + " --strategy " + around + " --pp 2 --batch-size 4 --global-batch-size 8 --microbatches 2", inf);
    expect_same(pp, single, 1e-5);
    for (size_t i = 0; i < single.steps.size(); ++i) {
      EXPECT_EQ(pp.steps[i].count("grad_norm"), single.steps[i].count("grad_norm")) << "step " << i + 1;
      if (single.steps[i].count("grad_norm") && pp.steps[i].count("grad_norm")) {  // (none for the skipped step)
        EXPECT_NEAR(pp.steps[i].at("grad_norm"), single.steps[i].at("grad_norm"), 1e-5 * single.steps[i].at("grad_norm"))
            << "step " << i + 1;
      }
      EXPECT_EQ(pp.steps[i].at("skipped"), single.steps[i].at("skipped")) << "step " << i + 1;
    }
    EXPECT_EQ(pp.steps[2].at("skipped"), 1.0);
  }
}

// --precision bf16: the stages' forwards under autocast (activations and their gradients cross
// in the dtype the stage returns), fp32 masters; as one process in bf16 to bf16's rounding.
// Each pipelined run's losses are nearer one bf16 process's than one fp32 process's (they differ by
// ~3e-4; bf16 runs among themselves by ~1e-4), so the stages did compute in bf16.
TEST(PipelineDemo, Bf16EqualsOneProcessInBf16) {
  const std::string common = std::string(kGpt) + " --precision bf16";
  const GptRun single = gpt(1, common + " --strategy single --batch-size 8");
  const GptRun fp32 = gpt(1, std::string(kGpt) + " --strategy single --batch-size 8");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  auto farthest = [](const GptRun& a, const GptRun& b) {
    double d = 0;
    for (size_t i = 0; i < a.steps.size() && i < b.steps.size(); ++i)
      d = std::max(d, std::abs(a.steps[i].at("loss") - b.steps[i].at("loss")));
    return d;
  };
  for (const auto& [world, flags] : std::vector<std::pair<int, std::string>>{
           {2, " --strategy single --pp 2 --batch-size 8 --global-batch-size 8 --microbatches 2"},
           {4, " --strategy fsdp --pp 2 --batch-size 4 --global-batch-size 8 --microbatches 2"}}) {
    SCOPED_TRACE(flags);
    const GptRun pp = gpt(world, common + flags);
    expect_same(pp, single, 1e-3);
    EXPECT_LT(farthest(pp, single), farthest(pp, fp32));
  }
}

// A user's own model (dtrain-mlp: a Sequential body and a head, cut by its hooks.stages).
TEST(PipelineDemo, UsersModelEqualsOneProcess) {
  const std::string common = " --steps 10 --threads 1 --lr 3e-3";
  const GptRun single = run_program("dtrain-mlp", 1, common + " --strategy single --batch-size 24");
  const GptRun pp3 = run_program("dtrain-mlp", 3, common + " --strategy single --pp 3 --batch-size 24 --global-batch-size 24 --microbatches 6");
  expect_same(pp3, single, 1e-5);
  const GptRun pp2dp2 =
      run_program("dtrain-mlp", 4, common + " --strategy ddp --pp 2 --batch-size 12 --global-batch-size 24 --schedule gpipe --microbatches 3");
  expect_same(pp2dp2, single, 1e-5);
  const GptRun pp2fsdp2 =
      run_program("dtrain-mlp", 4, common + " --strategy fsdp --pp 2 --batch-size 12 --global-batch-size 24 --microbatches 3");
  expect_same(pp2fsdp2, single, 1e-5);
}

// A checkpoint saved by a pipeline resumes without it and with another stage count, and a plain
// one resumes with a pipeline: each continues the uninterrupted run.
TEST(PipelineDemo, CheckpointsMoveBetweenLayouts) {
  const std::string common = std::string(kGpt) + " --batch-size 8 --global-batch-size 8";
  // (the last two: the sharded ways around the stages, FSDP's flat shards and ZeRO-1's owners,
  // write and read the model's own names; moves between data-parallel kinds around the stages are
  // PlanMatrix's chain, on a user's model)
  const std::string single = " --strategy single", pp2 = " --strategy single --pp 2";
  expect_moves_continue(common, gpt(1, common + single),
                        {Move{2, pp2, 1, single}, Move{1, single, 3, " --strategy single --pp 3 --microbatches 4"},
                         Move{4, " --strategy fsdp --pp 2 --batch-size 4", 1, single},
                         Move{1, single, 4, " --strategy zero1 --pp 2 --batch-size 4"}},
                        1e-5);
}

// (FSDP's CPU offload with --pp, refused by the plan, is in plan_test.cpp: a launch of 4 ranks to
// print it again was cut for CI's time.)
TEST(PipelineDemo, BadLayoutsAreClearErrors) {
  struct Bad {
    int world;
    std::string flags, says;
  };
  for (const Bad& b : {
           Bad{2, " --pp 3 --batch-size 6", "--pp 3 must divide the world size (2 ranks)"},
           Bad{2, " --pp 2 --virtual-stages 4 --layers 5", "cannot cut 5 GPT layers into 8 pipeline stages"},
           Bad{3, " --pp 3", "--microbatches 3 must divide the micro-batch of 8 samples (--batch-size)"},
           Bad{2, " --pp 2 --microbatches 3 --batch-size 8", "--microbatches 3 must divide the micro-batch of 8"},
           Bad{2, " --pp 2 --strategy zero2", "saves nothing over zero1"},
           Bad{2, " --pp 2 --virtual-stages 2 --microbatches 3 --batch-size 6",
               "micro-batches (3) to be a multiple of the pipeline ranks (2)"},
           // (found in the flags: one process is enough)
           Bad{1, " --schedule gpipe", "apply to pipeline parallelism (--pp N)"},
           Bad{1, " --pp 2 --strategy fsdp --wrap none", "with --pp each pipeline stage is one unit"},
       }) {
    const GptRun r = gpt(b.world, " --steps 2" + b.flags);
    EXPECT_NE(r.exit_code, 0) << b.flags;
    EXPECT_TRUE(contains(r.output, b.says)) << b.flags << "\n" << r.output;
  }
}

// A rank killed in the middle of a schedule: dtrun names it and the job ends, no hang.
TEST(PipelineDemo, AKilledStageEndsTheRunNamingIt) {
  const GptRun r = gpt(3, std::string(kGpt) + " --strategy single --pp 3 --microbatches 4 --collective-timeout 30",
                       "DTRAIN_TEST_FAIL_AT_STEP=3 DTRAIN_TEST_FAIL_RANK=1 ");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(contains(r.output, "worker rank 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "was killed by signal 9 (SIGKILL)")) << r.output;
}
