// dtrain-mlp: a user's model with no dtrain base class (a Sequential of Linear layers plus a plain
// head) trained by the library loop (train::fit). Every strategy at W = 1, 2, 3 reaches the same
// parameters as one process on the same global batch; FSDP units and recomputation reach the
// Sequential's layers without renaming a parameter, so checkpoints move between strategies.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <utility>
#include <tuple>

#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {

constexpr const char* kSmall = " --hidden 24 --depth 2 --samples 512 --batch-size 4 --steps 8 --lr 3e-3 --threads 1";

GptRun mlp(int world, const std::string& args) { return run_program("dtrain-mlp", world, kSmall + args); }

void expect_same(const GptRun& a, const GptRun& b, double tol, const std::string& what) {
  ASSERT_EQ(a.exit_code, 0) << what << "\n" << a.output;
  ASSERT_EQ(b.exit_code, 0) << what << "\n" << b.output;
  ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_NEAR(a.steps[i].at("loss"), b.steps[i].at("loss"), tol * std::abs(b.steps[i].at("loss")))
        << what << ", step " << i + 1;
  }
  const double sq = b.summary.at("param_sq");
  EXPECT_NEAR(a.summary.at("param_sq"), sq, tol * sq) << what;
  EXPECT_NEAR(a.summary.at("param_checksum"), b.summary.at("param_checksum"), tol * sq) << what;
}

}  // namespace

class MlpDemoParity : public ::testing::TestWithParam<int> {};

TEST_P(MlpDemoParity, EveryStrategyEqualsOneProcessWithTheGlobalBatch) {
  const int world = GetParam();
  const std::string global = " --batch-size " + std::to_string(4 * world);
  const GptRun single = mlp(1, " --strategy single" + global);
  for (const char* strategy : {"ddp", "zero1", "zero2", "fsdp", "hsdp"}) {
    expect_same(mlp(world, std::string(" --strategy ") + strategy), single, 1e-5, strategy);
  }
  // FSDP with one unit per Linear of the Sequential, recomputation of each, clipping and SGD.
  const GptRun single_clip = mlp(1, " --strategy single --clip-grad-norm 0.05 --optimizer sgd" + global);
  expect_same(mlp(world, " --strategy fsdp --activation-checkpointing --clip-grad-norm 0.05 --optimizer sgd"),
              single_clip, 1e-5, "fsdp + recompute + clip");
  expect_same(mlp(world, " --strategy zero2 --clip-grad-norm 0.05 --optimizer sgd --grad-accum 2 --batch-size 2"),
              single_clip, 1e-5, "zero2 + clip + accumulation");
}

INSTANTIATE_TEST_SUITE_P(Worlds, MlpDemoParity, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(MlpDemo, DataParallelWithoutGpusIsSingle) {
  const GptRun dp = mlp(1, " --strategy dp");
  const GptRun single = mlp(1, " --strategy single");
  expect_same(dp, single, 0, "dp on the CPU");
  EXPECT_TRUE(contains(dp.output, "--strategy dp spreads each batch over the GPUs of this process, and --device is "
                                  "cpu: training as --strategy single")) << dp.output;
  auto res = run_command(bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-mlp") +
                             " --strategy dp --steps 1 --threads 1", 60);
  EXPECT_NE(res.exit_code, 0);
  EXPECT_TRUE(contains(res.output, "--strategy dp is one process over all local GPUs (DataParallel), but WORLD_SIZE is 2"))
      << res.output;
}

TEST(MlpDemo, Learns) {
  const GptRun run = mlp(2, " --strategy fsdp --steps 60 --batch-size 16");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.steps.size(), 60u);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) {
    first += run.steps[i].at("loss");
    last += run.steps[50 + i].at("loss");
  }
  EXPECT_LT(last, 0.7 * first) << "mean loss of steps 51-60 against steps 1-10";
}

TEST(MlpDemo, CheckpointSavedUnderFsdpResumesUnderDdp) {
  // Saved by FSDP at W=2 under the plain model's names, resumed by DDP at W=1 with the same global
  // batch: the same run as an uninterrupted one.
  const std::string ckpt = temp_dir() + "/ck";
  const GptRun full = mlp(1, " --strategy single --batch-size 8");
  const GptRun first = mlp(2, " --strategy fsdp --steps 4 --save " + ckpt);
  const GptRun rest = mlp(1, " --strategy ddp --batch-size 8 --resume " + ckpt);
  expect_continues(first, rest, full, 1e-5);
  EXPECT_TRUE(contains(rest.output, "dtrain-mlp: resumed from " + ckpt + "/step-00000004: step 4")) << rest.output;
}

// The user's model written from tensor-parallel layers (ParallelRegressor: column and row layers
// alternating, the plain model's names) trains like the plain one in one process, alone, inside
// FSDP and inside pipeline stages; its checkpoint resumes as the plain model.
TEST(MlpDemo, TensorParallelUsersModelEqualsOneProcess) {
  // (4 samples a step in every plan: Design note [the global batch])
  const std::string clip = " --clip-grad-norm 0.05 --global-batch-size 4";
  const GptRun single = mlp(1, " --strategy single" + clip);
  expect_same(mlp(2, " --strategy single --tp 2" + clip), single, 1e-5, "tp 2");
  expect_same(mlp(4, " --strategy fsdp --tp 2 --batch-size 2 --activation-checkpointing" + clip), single, 1e-5,
              "tp 2 x fsdp 2, recomputed");
  expect_same(mlp(4, " --strategy single --tp 2 --pp 2" + clip), single, 1e-5, "tp 2 x pp 2");
  const std::string ckpt = temp_dir() + "/ck";
  const GptRun first = mlp(2, " --strategy single --tp 2 --steps 4 --save " + ckpt + clip);
  const GptRun rest = mlp(1, " --strategy single --resume " + ckpt + clip);
  expect_continues(first, rest, single, 1e-5);
}

TEST(MlpDemo, FlagsAndErrorsAreTheLibrarys) {
  auto res = run_command(bin("dtrain-mlp") + " --help", 30);
  EXPECT_EQ(res.exit_code, 0);
  EXPECT_TRUE(contains(res.output, "--strategy S")) << res.output;
  EXPECT_TRUE(contains(res.output, "--hidden N --depth N")) << res.output;
  // Bad command lines: exit code 2 and the message naming the flag.
  const std::pair<const char*, const char*> bad[] = {
      {" --strategy zero9", "dtrain-mlp: --strategy must be single, dp, ddp, zero1, zero2, fsdp, hsdp or auto"},
      {" --precision fp16", "--precision fp16 needs --device cuda"},
      {" --strategy ddp --wrap none", "--wrap applies to --strategy fsdp or hsdp"},
      {" --depth -1", "--depth expects an integer >= 0"},
  };
  for (const auto& [args, message] : bad) {
    res = run_command(bin("dtrain-mlp") + args, 30);
    EXPECT_EQ(res.exit_code, 2) << args;
    EXPECT_TRUE(contains(res.output, message)) << args << "\n" << res.output;
  }
  // An error inside a rank: one line naming the program and the rank, exit code 1 (no backtrace).
  res = run_command(bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-mlp") +
                        " --strategy single --steps 1 --threads 1", 60);
  EXPECT_NE(res.exit_code, 0);
  EXPECT_TRUE(contains(res.output, "dtrain-mlp [rank 1]: error: --strategy single trains one replica on 1 rank(s), "
                                   "but WORLD_SIZE is 2")) << res.output;
  EXPECT_FALSE(contains(res.output, "frame #")) << res.output;
}

// One configuration document: a run started with --config equals the same run started with flags
// (bit for bit), the command line overrides the document, --print-config's document is the run's;
// a mistyped flag under dtrun is one line per rank naming the nearest flag, not the usage.
TEST(MlpDemo, AConfigDocumentIsTheRunItsFlagsAre) {
  const std::string flags = " --strategy fsdp --clip-grad-norm 0.05 --optimizer sgd";
  const GptRun by_flags = mlp(2, flags);
  const std::string dir = temp_dir();
  std::ofstream(dir + "/run.toml") << "strategy = \"fsdp\"\nclip_grad_norm = 0.05\noptimizer = \"sgd\"\nlr = 0.5\n";
  const GptRun by_doc = mlp(2, " --config " + dir + "/run.toml");  // (kSmall's --lr on the command line over the 0.5)
  ASSERT_EQ(by_doc.exit_code, 0) << by_doc.output;
  ASSERT_EQ(by_flags.exit_code, 0) << by_flags.output;
  EXPECT_EQ(by_doc.summary.at("param_checksum"), by_flags.summary.at("param_checksum"));
  EXPECT_EQ(by_doc.summary.at("param_sq"), by_flags.summary.at("param_sq"));
  // The printed document holds everything, the program's own flags (--hidden ...) too.
  auto printed = run_command(bin("dtrain-mlp") + kSmall + flags + " --print-config", 30);
  ASSERT_EQ(printed.exit_code, 0) << printed.output;
  std::ofstream(dir + "/printed.toml") << printed.output;
  const GptRun by_printed = run_program("dtrain-mlp", 2, " --config " + dir + "/printed.toml");
  ASSERT_EQ(by_printed.exit_code, 0) << by_printed.output;
  EXPECT_EQ(by_printed.summary.at("param_checksum"), by_flags.summary.at("param_checksum"));
  auto typo = run_command(bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-mlp") + " --bach-size 4", 60);
  EXPECT_NE(typo.exit_code, 0);
  EXPECT_TRUE(contains(typo.output, "dtrain-mlp: unknown option '--bach-size' (did you mean --batch-size?) (dtrain-mlp "
                                    "--help lists every flag)")) << typo.output;
  EXPECT_FALSE(contains(typo.output, "usage:")) << typo.output;
}

// Learning-rate schedules in the library loop (optim/lr_schedule.h): a cosine schedule with
// warm-up and AdamW's own settings trains equal to one process at W = 1, 2, 3; each step's lr is
// the schedule's (written here independently); a run stopped after the save at step 4 and resumed
// at another layout continues the same curve (the lrs bit-equal), and a changed schedule at resume
// is said.
TEST(MlpDemo, ScheduleIsOneCurveAtEveryWorldAndAcrossAResume) {
  const std::string schedule =
      " --lr-schedule cosine --warmup-steps 2 --min-lr 3e-4 --weight-decay 0.1 --beta2 0.99 --global-batch-size 12 --batch-size 2";
  const GptRun single = mlp(1, " --strategy single" + schedule);
  ASSERT_EQ(single.exit_code, 0) << single.output;
  ASSERT_EQ(single.steps.size(), 8u);
  EXPECT_TRUE(contains(single.output, "learning rate 0.003, cosine, warm-up 2 to 0.1 x lr at step 8")) << single.output;
  for (size_t i = 0; i < 8; ++i) {  // warm-up s/3, then cosine from 1 at step 3 to 0.1 at step 8
    const double s = static_cast<double>(i + 1);
    const double factor = s <= 2 ? s / 3 : 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * (s - 3) / 5));
    EXPECT_NEAR(single.steps[i].at("lr"), 3e-3 * factor, 1e-15) << "step " << i + 1;
  }
  expect_same(mlp(2, " --strategy ddp" + schedule), single, 1e-5, "ddp W=2");
  expect_same(mlp(3, " --strategy zero2" + schedule), single, 1e-5, "zero2 W=3");
  // Stopped at step 5 (after the save of step 4), resumed under another layout.
  const std::string ckpt = temp_dir() + "/ck";
  const GptRun first = run_program("dtrain-mlp", 2, kSmall + std::string(" --strategy fsdp --save-every 4 --save ") + ckpt + schedule,
                                   "DTRAIN_TEST_FAIL_AT_STEP=5 ", " --max-restarts 0");
  ASSERT_EQ(first.steps.size(), 4u) << first.output;
  const GptRun rest = mlp(3, " --strategy zero1 --resume " + ckpt + schedule);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  ASSERT_EQ(rest.steps.size(), 4u) << rest.output;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(first.steps[i].at("lr"), single.steps[i].at("lr")) << "step " << i + 1;
    EXPECT_EQ(rest.steps[i].at("lr"), single.steps[4 + i].at("lr")) << "step " << i + 5;
    EXPECT_NEAR(rest.steps[i].at("loss"), single.steps[4 + i].at("loss"), 1e-5 * single.steps[4 + i].at("loss")) << "step " << i + 5;
  }
  for (const char* key : {"lr:", "lr-schedule:", "warmup-steps:", "min-lr:", "metrics:", "save:"}) {  // (only the layout changed)
    EXPECT_FALSE(contains(rest.output, std::string("; ") + key) || contains(rest.output, std::string("in: ") + key)) << key << "\n" << rest.output;
  }
  EXPECT_FALSE(contains(rest.output, "the checkpoint's learning rate")) << rest.output;
  const GptRun changed = mlp(1, " --strategy single --steps 5 --resume " + ckpt + schedule + " --min-lr 0");
  ASSERT_EQ(changed.exit_code, 0) << changed.output;
  EXPECT_TRUE(contains(changed.output, "this run differs from the checkpoint's in: ")) << changed.output;
  EXPECT_TRUE(contains(changed.output, "min-lr: 3e-04 -> 0.0")) << changed.output;
}
