// FSDP and HSDP training checkpoints end to end through dtrun + dtrain-gpt (the other strategies are
// in resume_test.cpp): resumed at the same world size a run is bit-exact (losses, parameters and
// the optimizer state of the next checkpoint); resharded 4 -> 2 -> 1 -> 3 across fsdp and single,
// and across strategies (zero2 -> fsdp, fsdp -> ddp), it continues the uninterrupted run within
// 1e-5; a rank killed under dtrun --max-restarts resumes from the last checkpoint; and
// --export-weights writes one plain safetensors file with the final parameters, the same from fsdp
// at W=2 as from a single process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/util/fs.h"
#include "resume_testing.h"
#include "tensor_files.h"

using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;
namespace ck = dtrain::checkpoint;

namespace {

// Two blocks: the FSDP runs have three units (two blocks and the root).
const std::string kTwoBlocks = " --layers 2";

// `seg` resumed from the checkpoint of step `start` and trained start+1..: its losses are `full`'s
// (tol as expect_continues).
void expect_segment(const GptRun& seg, size_t start, const GptRun& full, double tol, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(seg.exit_code, 0) << seg.output;
  ASSERT_FALSE(seg.steps.empty()) << seg.output;
  EXPECT_EQ(seg.summary.at("start_step"), static_cast<double>(start));
  ASSERT_LE(start + seg.steps.size(), full.steps.size());
  for (size_t i = 0; i < seg.steps.size(); ++i) {
    EXPECT_EQ(seg.steps[i].at("step"), static_cast<double>(start + i + 1));
    const double a = seg.steps[i].at("loss"), b = full.steps[start + i].at("loss");
    EXPECT_NEAR(a, b, tol * std::abs(b)) << "step " << start + i + 1;
  }
}

}  // namespace

// A 6-step run saving after steps 3 and 6, and a run resumed from its step-3 checkpoint that saves
// after step 6 too: steps 4-6 repeat the first run's losses, and the two step-6 checkpoints hold
// the same parameters and optimizer state, bit for bit. Each rank wrote its own shard: the
// checkpoint names W saving ranks.
struct BitExactCase {
  std::string name;
  int world;
  std::string flags;
};

void PrintTo(const BitExactCase& c, std::ostream* os) { *os << c.name; }

class FsdpResumeBitExact : public ::testing::TestWithParam<BitExactCase> {};

TEST_P(FsdpResumeBitExact, SavedAndResumedEqualsUninterrupted) {
  const BitExactCase& c = GetParam();
  const std::string args = kTwoBlocks + c.flags + " --batch-size 2 --clip-grad-norm 0.5 --steps 6";
  const std::string ckpt = temp_dir() + "/ckpt", again = temp_dir() + "/again";
  const GptRun full = gpt(c.world, args + " --save " + ckpt + " --save-every 3 --resume " + ckpt);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const GptRun rest = gpt(c.world, args + " --resume " + ckpt + "/step-00000003 --save " + again);
  EXPECT_TRUE(contains(rest.output, "resumed from " + ckpt + "/step-00000003: step 3 (saved by " +
                                        std::to_string(c.world) + " rank(s)"))
      << rest.output;
  GptRun first = full;
  first.steps.resize(3);
  expect_continues(first, rest, full, 0);
  ASSERT_EQ(rest.exit_code, 0);
  EXPECT_EQ(ck::Reader::open(ckpt).saved_world_size(), c.world);
  expect_same_tensors(checkpoint_tensors(again + "/step-00000006"), checkpoint_tensors(ckpt + "/step-00000006"), 0,
                      "step-6 checkpoints of the resumed and the uninterrupted run");
}

INSTANTIATE_TEST_SUITE_P(Sharding, FsdpResumeBitExact,
                         ::testing::Values(BitExactCase{"fsdp", 2, " --strategy fsdp"},
                                           BitExactCase{"hsdp_2x1", 2, " --strategy hsdp --shard-size 1"},
                                           BitExactCase{"hsdp_2x2", 4, " --strategy hsdp --shard-size 2"}),
                         [](const auto& info) { return info.param.name; });

// The example: saved by fsdp at W=4, resumed by fsdp at W=2 (and saved), by a single
// process (and saved), by fsdp at W=3; the global batch stays 12 sequences throughout, so every
// segment continues the uninterrupted single-process run: losses, final parameters (exported) and
// the final checkpoint's parameters and AdamW state all within 1e-5.
TEST(FsdpResumeResharded, FourToTwoToOneToThree) {
  const std::string ckpt = temp_dir() + "/ckpt", full_ckpt = temp_dir() + "/full";
  const std::string exported = temp_dir() + "/chain.safetensors", full_exported = temp_dir() + "/full.safetensors";
  const std::string common = kTwoBlocks + " --clip-grad-norm 0.5 --save " + ckpt + " --resume " + ckpt;
  const GptRun full = gpt(1, kTwoBlocks + " --clip-grad-norm 0.5 --strategy single --batch-size 12 --steps 8 --save " +
                                 full_ckpt + " --export-weights " + full_exported);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  ASSERT_EQ(full.steps.size(), 8u);

  const GptRun w4 = gpt(4, common + " --strategy fsdp --batch-size 3 --steps 2");
  expect_segment(w4, 0, full, 1e-5, "fsdp W=4, steps 1-2");
  const GptRun w2 = gpt(2, common + " --strategy fsdp --batch-size 6 --steps 4");
  EXPECT_TRUE(contains(w2.output, "step 2 (saved by 4 rank(s) with --strategy fsdp)")) << w2.output;
  expect_segment(w2, 2, full, 1e-5, "fsdp W=2, steps 3-4");
  const GptRun w1 = gpt(1, common + " --strategy single --batch-size 12 --steps 6");
  EXPECT_TRUE(contains(w1.output, "step 4 (saved by 2 rank(s) with --strategy fsdp)")) << w1.output;
  expect_segment(w1, 4, full, 1e-5, "single, steps 5-6");
  const GptRun w3 = gpt(3, common + " --strategy fsdp --batch-size 4 --steps 8 --export-weights " + exported);
  EXPECT_TRUE(contains(w3.output, "step 6 (saved by 1 rank(s) with --strategy single)")) << w3.output;
  expect_segment(w3, 6, full, 1e-5, "fsdp W=3, steps 7-8");
  ASSERT_EQ(w3.exit_code, 0);

  const double sq = full.summary.at("param_sq");
  EXPECT_NEAR(w3.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-5 * sq);
  EXPECT_NEAR(w3.summary.at("param_sq"), sq, 1e-5 * sq);
  expect_same_tensors(read_safetensors(exported), read_safetensors(full_exported), 1e-5, "exported weights");
  expect_same_tensors(checkpoint_tensors(ckpt + "/step-00000008"), checkpoint_tensors(full_ckpt + "/step-00000008"),
                      1e-5, "step-8 checkpoints (parameters and AdamW state)");
}

// Across strategies, global batch 12: a zero2 checkpoint (W=2) resumed by fsdp at W=3, an fsdp
// checkpoint (W=2) resumed by ddp at W=3, an fsdp checkpoint (W=3) resumed by hsdp 2x2 (W=4); each
// continues the uninterrupted single-process run (1e-5): losses, exported final weights, and the
// resumed run's final checkpoint with the AdamW state (but hsdp's).
struct CrossCase {
  std::string name;
  std::string saved;  // strategy flags of the saving run (steps 1-3)
  int saved_world;
  std::string resumed;  // of the resumed run (steps 4-6)
  int resumed_world;
  bool resumed_saves = true;  // the resumed run saves its step-6 checkpoint (compared too)
};

void PrintTo(const CrossCase& c, std::ostream* os) { *os << c.name; }

class FsdpResumeAcrossStrategies : public ::testing::TestWithParam<CrossCase> {};

TEST_P(FsdpResumeAcrossStrategies, ContinuesTheUninterruptedRun) {
  const CrossCase& c = GetParam();
  const int64_t global_batch = 12;
  const std::string ckpt = temp_dir() + "/ckpt", full_ckpt = temp_dir() + "/full";
  const std::string exported = temp_dir() + "/rest.safetensors", full_exported = temp_dir() + "/full.safetensors";
  const std::string base = kTwoBlocks + " --clip-grad-norm 0.5";
  const auto batch = [&](int world) { return " --batch-size " + std::to_string(global_batch / world); };
  const GptRun full = gpt(1, base + " --strategy single" + batch(1) + " --steps 6 --save " + full_ckpt +
                                 " --export-weights " + full_exported);
  const GptRun first = gpt(c.saved_world, base + c.saved + batch(c.saved_world) + " --steps 3 --save " + ckpt);
  const GptRun rest = gpt(c.resumed_world, base + c.resumed + batch(c.resumed_world) + " --steps 6 --resume " + ckpt +
                                               (c.resumed_saves ? " --save " + ckpt : std::string()) +
                                               " --export-weights " + exported);
  EXPECT_TRUE(contains(rest.output, "step 3 (saved by " + std::to_string(c.saved_world) + " rank(s) with" + c.saved +
                                        ")"))
      << rest.output;
  expect_continues(first, rest, full, 1e-5);
  ASSERT_EQ(rest.exit_code, 0);
  expect_same_tensors(read_safetensors(exported), read_safetensors(full_exported), 1e-5, "exported weights");
  if (!c.resumed_saves) return;
  expect_same_tensors(checkpoint_tensors(ckpt + "/step-00000006"), checkpoint_tensors(full_ckpt + "/step-00000006"),
                      1e-5, "step-6 checkpoints (parameters and AdamW state)");
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, FsdpResumeAcrossStrategies,
    ::testing::Values(CrossCase{"zero2_to_fsdp", " --strategy zero2", 2, " --strategy fsdp", 3},
                      CrossCase{"fsdp_to_ddp", " --strategy fsdp", 2, " --strategy ddp", 3},
                      // (hsdp resumes without saving: saving from hsdp is FsdpResumeBitExact's)
                      CrossCase{"fsdp_to_hsdp", " --strategy fsdp", 3, " --strategy hsdp --shard-size 2", 4, false}),
    [](const auto& info) { return info.param.name; });

// One fsdp rank kills itself at step 5 (after the checkpoint of step 4); dtrun restarts the group
// with the same command line, which resumes from step 4 and ends bit for bit where the
// uninterrupted run does (losses, parameters, and the step-6 checkpoint with the AdamW state).
TEST(FsdpResume, KilledRankRestartsFromTheLastCheckpoint) {
  const std::string args = kTwoBlocks + " --strategy fsdp --batch-size 2 --steps 6";
  const std::string ckpt = temp_dir() + "/ckpt", full_ckpt = temp_dir() + "/full";
  const GptRun full = gpt(2, args + " --save " + full_ckpt);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const GptRun crashed = gpt(2, args + " --save " + ckpt + " --save-every 2 --resume " + ckpt,
                             "DTRAIN_TEST_FAIL_AT_STEP=5 ", " --max-restarts 1");
  expect_restarted_from_step_4(crashed, full, ckpt);
  if (HasFatalFailure()) return;
  expect_same_tensors(checkpoint_tensors(ckpt + "/step-00000006"), checkpoint_tensors(full_ckpt + "/step-00000006"), 0,
                      "step-6 checkpoints");
}

// --export-weights from fsdp at W=2 (streamed unit by unit by rank 0) and from a single process
// that loaded fsdp's final checkpoint (no steps left: it exports what it loaded) give the same
// file content bit for bit: every parameter of the model once and the buffers, equal to the
// checkpoint's model/ tensors, whose sums are the run's final param_checksum / param_sq.
TEST(FsdpExportWeights, FsdpAndSingleWriteTheSameFinalParameters) {
  const std::string ckpt = temp_dir() + "/ckpt";
  const std::string from_fsdp = temp_dir() + "/fsdp.safetensors", from_single = temp_dir() + "/single.safetensors";
  const GptRun fsdp = gpt(2, kTwoBlocks + " --strategy fsdp --batch-size 2 --steps 3 --save " + ckpt +
                                 " --export-weights " + from_fsdp);
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.output;
  EXPECT_TRUE(contains(fsdp.output, "exported the weights to " + from_fsdp)) << fsdp.output;
  const GptRun single = gpt(1, kTwoBlocks + " --strategy single --batch-size 4 --steps 3 --resume " + ckpt +
                                   " --export-weights " + from_single);
  ASSERT_EQ(single.exit_code, 0) << single.output;
  EXPECT_TRUE(single.steps.empty()) << "the checkpoint is at the last step: nothing to train";

  const Tensors a = read_safetensors(from_fsdp), b = read_safetensors(from_single);
  expect_same_tensors(a, b, 0, "fsdp's and single's exported weights");
  // The checkpoint's model/ keys, without the prefix: the final parameters (and buffers).
  Tensors final_params;
  for (const auto& [key, value] : checkpoint_tensors(ckpt + "/step-00000003")) {
    if (key.rfind("model/", 0) == 0) final_params[key.substr(6)] = value;
  }
  EXPECT_TRUE(final_params.count("blocks.1.qkv.weight") && final_params.count("lm_head.weight"));
  expect_same_tensors(a, final_params, 0, "exported weights vs the final checkpoint");
  double sum = 0, sq = 0;
  for (const auto& [name, t] : a) {
    sum += t.to(at::kDouble).sum().item<double>();
    sq += t.to(at::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_NEAR(sum, fsdp.summary.at("param_checksum"), 1e-9 * fsdp.summary.at("param_sq"));
  EXPECT_NEAR(sq, fsdp.summary.at("param_sq"), 1e-9 * fsdp.summary.at("param_sq"));
  const auto dir = dtrain::util::fs::parent_path(from_fsdp);
  EXPECT_EQ(dtrain::util::fs::list_directory(dir).size(), 1u)
      << "only the exported file, no temporary file left in " << dir;
}
