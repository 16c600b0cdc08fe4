// --tp in the library loop, in real processes under dtrun: dtrain-gpt built from tensor-parallel
// layers trains like one process (same global batch, AdamW, fp32) at TP 2 and 4, with sequence
// parallelism, with DDP around it and with clipping; checkpoints move between TP degrees and the
// plain model; bad layouts are clear errors.
#include <gtest/gtest.h>

#include "examples/resume_testing.h"
#include "testing/testing.h"

using namespace dtrain::testing;
using namespace dtrain::testing::resume;

namespace {

// 4 heads (TP 4 divides them), the math attention the TP block computes, global-norm clipping.
const char* kModel = " --layers 2 --heads 4 --attention math --steps 10 --clip-grad-norm 0.5";

}  // namespace

TEST(TensorParallelDemo, GptEqualsOneProcess) {
  const GptRun single = gpt(1, std::string(kModel) + " --strategy single --batch-size 8");
  struct Run {
    int world;
    std::string flags;
  };
  for (const Run& r : {Run{2, "--strategy single --tp 2 --batch-size 8"},
                       Run{4, "--strategy single --tp 4 --batch-size 8 --sequence-parallel"},
                       Run{4, "--strategy ddp --tp 2 --batch-size 4 --sequence-parallel"}}) {
    SCOPED_TRACE(r.flags);
    const GptRun tp = gpt(r.world, std::string(kModel) + " " + r.flags);
    expect_same(tp, single, 1e-5);
    EXPECT_TRUE(contains(tp.output, "tensor parallel over")) << tp.output;
  }
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

TEST(TensorParallelDemo, BadLayoutsAreClearErrors) {
  struct Bad {
    int world;
    std::string flags, says;
  };
  for (const Bad& b : {
           Bad{3, " --heads 4 --tp 3 --strategy single", "the vocabulary (256) does not divide by the tensor-parallel degree 3"},
           Bad{2, " --heads 3 --d-model 48 --tp 2 --strategy single", "3 attention heads do not divide by the tensor-parallel degree 2"},
           Bad{3, " --tp 2 --strategy ddp", "--tp 2 must divide the world size (3 ranks)"},
           Bad{1, " --tp 2 --strategy fsdp", "--tp with --strategy fsdp is not supported yet"},
           Bad{1, " --sequence-parallel", "--sequence-parallel applies to tensor parallelism"},
       }) {
    const GptRun r = gpt(b.world, " --steps 2" + b.flags);
    EXPECT_NE(r.exit_code, 0) << b.flags;
    EXPECT_TRUE(contains(r.output, b.says)) << b.flags << "\n" << r.output;
  }
}
