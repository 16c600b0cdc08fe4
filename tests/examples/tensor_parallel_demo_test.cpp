// --tp in the library loop, in real processes under dtrun: dtrain-gpt built from tensor-parallel
// layers trains like one process (same global batch, AdamW, fp32) at TP 2 and 4, with sequence
// parallelism, with DDP, FSDP or HSDP around it, with activation checkpointing and with clipping;
// checkpoints move between TP degrees, the plain model and other layouts; bad layouts are clear
// errors.
#include <gtest/gtest.h>

#include "examples/resume_testing.h"
#include "examples/tensor_files.h"
#include "testing/testing.h"

using namespace dtrain::testing;
using namespace dtrain::testing::resume;

namespace {

// 4 heads (TP 4 divides them), the math attention the TP block computes, global-norm clipping.
// (every run trains 8 samples a step, whatever its plan: Design note [the global batch])
const char* kModel = " --layers 2 --heads 4 --attention math --steps 10 --clip-grad-norm 0.5 --global-batch-size 8";

// A layout to run dtrain-gpt in: `world` ranks and its flags.
struct Layout {
  int world;
  std::string flags;
};

// Each run trains like one process (kModel, the global batch 8; 1e-5) and prints `says`.
void expect_like_one_process(const std::vector<Layout>& runs, const std::string& says) {
  const GptRun single = gpt(1, std::string(kModel) + " --strategy single --batch-size 8");
  for (const Layout& r : runs) {
    SCOPED_TRACE(r.flags);
    const GptRun tp = gpt(r.world, std::string(kModel) + " " + r.flags);
    expect_same(tp, single, 1e-5);
    EXPECT_TRUE(contains(tp.output, says)) << tp.output;
  }
}

}  // namespace

TEST(TensorParallelDemo, GptEqualsOneProcess) {
  expect_like_one_process({Layout{2, "--strategy single --tp 2 --batch-size 8"},
                           Layout{4, "--strategy single --tp 4 --batch-size 8 --sequence-parallel"},
                           Layout{4, "--strategy ddp --tp 2 --batch-size 4 --sequence-parallel"}},
                          " x tensor ");
}

// FSDP / HSDP over each tensor rank's data-parallel group (Design note [TP inside FSDP]).
TEST(TensorParallelDemo, InsideFsdpEqualsOneProcess) {
  expect_like_one_process({Layout{4, "--strategy fsdp --wrap layer --tp 2 --batch-size 4"},
                           // hsdp's default shard group: this node's data-parallel ranks of a tensor rank (2)
                           Layout{4, "--strategy hsdp --wrap layer --tp 2 --batch-size 4 --sequence-parallel"},
                           // replicas of shard groups: 2 x 2 data-parallel ranks per tensor rank
                           Layout{8, "--strategy hsdp --shard-size 2 --wrap layer --tp 2 --batch-size 2 --threads 1"}},
                          "sdp over ");
}

// TP inside pipeline stages: the pipeline joins the ranks of one tensor rank; with DDP around the
// stages at W = 8 (pipeline 2 x data 2 x tensor 2).
TEST(TensorParallelDemo, InsidePipelineStagesEqualsOneProcess) {
  expect_like_one_process({Layout{4, "--strategy single --tp 2 --pp 2 --batch-size 8"},
                           Layout{4, "--strategy single --tp 2 --pp 2 --batch-size 8 --sequence-parallel --microbatches 4"},
                           Layout{8, "--strategy ddp --tp 2 --pp 2 --batch-size 4 --threads 1"}},
                          " x pipeline 2 (");
}

// Recomputation replays each block's forward, collectives included, in backward: the same
// training, and more bytes sent per step (the forward's all-reduces twice).
TEST(TensorParallelDemo, ActivationCheckpointingReplaysTheRegions) {
  const GptRun single = gpt(1, std::string(kModel) + " --strategy single --batch-size 8");
  const std::string tp2 = std::string(kModel) + " --strategy single --tp 2 --batch-size 8";
  const GptRun plain = gpt(2, tp2);
  const GptRun recomputed = gpt(2, tp2 + " --activation-checkpointing");
  expect_same(recomputed, single, 1e-5);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  ASSERT_FALSE(plain.steps.empty());
  EXPECT_GT(recomputed.steps.back().at("comm_mib_sent"), 1.2 * plain.steps.back().at("comm_mib_sent"));
}

// Design note [dropout streams]: dropout draws the masks of one process (the plain GPT, math
// attention) at TP 2, at TP 4 with sequence parallelism and when recomputation replays the blocks;
// it does drop (the run differs from one without dropout).
TEST(TensorParallelDemo, DropoutEqualsOneProcessAtEveryDegree) {
  const std::string common = std::string(kModel) + " --strategy single --batch-size 8 --dropout 0.1";
  const GptRun single = gpt(1, common);
  for (const Layout& r : {Layout{2, " --tp 2"}, Layout{4, " --tp 4 --sequence-parallel"},
                          Layout{2, " --tp 2 --activation-checkpointing"}}) {
    SCOPED_TRACE(r.flags);
    expect_same(gpt(r.world, common + r.flags), single, 1e-5);
  }
  const GptRun none = gpt(1, std::string(kModel) + " --strategy single --batch-size 8");
  ASSERT_EQ(none.exit_code, 0) << none.output;
  EXPECT_GT(std::abs(none.steps.back().at("loss") - single.steps.back().at("loss")), 1e-3);
}

// Two pipeline stages draw different streams; resumed at TP 2 both tensor ranks take tensor rank
// 0's (its saved one), so the run is the one a single process resuming the checkpoint trains.
TEST(TensorParallelDemo, DropoutStreamsAgreeAfterResumingAtAnotherLayout) {
  const std::string common = std::string(kModel) + " --strategy single --batch-size 8 --dropout 0.1";
  const std::string ckpt = temp_dir() + "/ck";
  const GptRun first = gpt(2, common + " --pp 2 --steps 4 --save " + ckpt);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const GptRun one = gpt(1, common + " --resume " + ckpt);
  expect_same(gpt(2, common + " --tp 2 --resume " + ckpt), one, 1e-5);
}

// Each rank writes 1/W of every full tensor: a TP checkpoint resumes without TP, a plain one with it.
TEST(TensorParallelDemo, CheckpointsMoveBetweenDegrees) {
  const std::string common = std::string(kModel) + " --batch-size 8";
  const GptRun full = gpt(1, common + " --strategy single");
  {
    const std::string ckpt = temp_dir() + "/ck";
    const GptRun first = gpt(2, common + " --strategy single --tp 2 --steps 4 --save " + ckpt);
    const GptRun rest = gpt(1, common + " --strategy single --resume " + ckpt);
    SCOPED_TRACE("tp 2 -> single");
    expect_continues(first, rest, full, 1e-5);
  }
  {
    const std::string ckpt = temp_dir() + "/ck";
    const GptRun first = gpt(1, common + " --strategy single --steps 4 --save " + ckpt);
    const GptRun rest = gpt(4, common + " --strategy single --tp 4 --sequence-parallel --resume " + ckpt);
    SCOPED_TRACE("single -> tp 4 (sequence parallel)");
    expect_continues(first, rest, full, 1e-5);
  }
}

// TP inside FSDP writes ranges of the full tensors (no gather); they load into any layout. (Moves
// between TP's data-parallel kinds and pipeline degrees are PlanMatrix's chain, on a user's model.)
TEST(TensorParallelDemo, CheckpointsMoveBetweenLayouts) {
  const std::string common = std::string(kModel) + " --batch-size 8";
  const std::string fsdp = " --strategy fsdp --wrap layer --tp 2 --batch-size 4";
  expect_moves_continue(common, gpt(1, common + " --strategy single"),
                        {Move{4, fsdp, 1, " --strategy single"},
                         Move{1, " --strategy single", 4, fsdp + " --sequence-parallel"},
                         Move{4, fsdp, 2, " --strategy ddp --tp 2 --batch-size 8"},
                         Move{1, " --strategy single", 4, " --strategy single --tp 2 --pp 2 --sequence-parallel"}},
                        1e-5);
}

// --export-weights writes the plain model's full tensors from every TP layout.
TEST(TensorParallelDemo, ExportsThePlainModel) {
  const std::string common = std::string(kModel) + " --steps 3 --batch-size 8 --export-weights ";
  const std::string want = temp_dir() + "/single.safetensors";
  const GptRun single = gpt(1, common + want + " --strategy single");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  for (const Layout& r : {Layout{2, " --strategy single --tp 2"}, Layout{4, " --strategy fsdp --wrap layer --tp 2 --batch-size 4"},
                       Layout{4, " --strategy single --tp 2 --pp 2"}}) {
    SCOPED_TRACE(r.flags);
    const std::string got = temp_dir() + "/tp.safetensors";
    const GptRun tp = gpt(r.world, common + got + r.flags);
    ASSERT_EQ(tp.exit_code, 0) << tp.output;
    expect_same_tensors(read_safetensors(got), read_safetensors(want), 1e-5, "exported weights");
  }
}

// (The plan's own refusals, degrees that do not divide the world and zero2 with --pp, are checked
// in plan_test.cpp and reach a program's user in PipelineDemo.BadLayoutsAreClearErrors and
// PlanMatrix: each costs a launch of W ranks, so they are not repeated here.)
TEST(TensorParallelDemo, BadLayoutsAreClearErrors) {
  struct Bad {
    int world;
    std::string flags, says;
  };
  for (const Bad& b : {
           Bad{3, " --heads 4 --tp 3 --strategy single", "the vocabulary (256) does not divide by the tensor-parallel degree 3"},
           Bad{2, " --heads 3 --d-model 48 --tp 2 --strategy single", "3 attention heads do not divide by the tensor-parallel degree 2"},
           Bad{2, " --tp 2 --strategy hsdp --shard-size 3", "must divide the 1 data-parallel rank(s)"},
           Bad{1, " --sequence-parallel", "--sequence-parallel applies to tensor parallelism"},
       }) {
    const GptRun r = gpt(b.world, " --steps 2" + b.flags);
    EXPECT_NE(r.exit_code, 0) << b.flags;
    EXPECT_TRUE(contains(r.output, b.says)) << b.flags << "\n" << r.output;
  }
}
