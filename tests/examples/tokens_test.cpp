// Token data and generation, as a new user meets them: dtrain-tokenize trains a SentencePiece
// model on text and writes Megatron shards; dtrain-gpt trains on them with a held-out set and a
// cosine schedule, and --generate continues a prompt from the checkpoint (any plan) on one
// process, through the tokenizer or in bytes.
#include <gtest/gtest.h>

#include <string>
#include <unistd.h>

#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {
constexpr const char* kGptShape = " --layers 1 --d-model 32 --heads 2 --seq-len 32 --threads 1";
}

TEST(Tokens, TokenizeTrainEvaluateGenerate) {
  if (::access(bin("dtrain-tokenize").c_str(), X_OK) != 0) GTEST_SKIP() << "dtrain-tokenize not built (no libsentencepiece-dev)";
  const std::string dir = temp_dir();
  auto tok = run_command(bin("dtrain-tokenize") + " --input /usr/share/common-licenses --output " + dir +
                             " --vocab-size 512 --val-fraction 0.05",
                         120);
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  EXPECT_TRUE(contains(tok.output, "vocabulary 512")) << tok.output;
  EXPECT_TRUE(contains(tok.output, "validation under " + dir + "/val")) << tok.output;
  const std::string ckpt = dir + "/ck";
  const GptRun trained = run_program("dtrain-gpt", 2, std::string(kGptShape) + " --data " + dir + "/train --val-data " + dir +
                                                          "/val --vocab-size 512 --strategy fsdp --steps 12 --batch-size 4"
                                                          " --lr 3e-3 --lr-schedule cosine --warmup-steps 2 --eval-every 6 --save " + ckpt);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  ASSERT_EQ(trained.steps.size(), 12u);
  EXPECT_LT(trained.steps.back().at("loss"), trained.steps.front().at("loss"));
  EXPECT_LT(trained.steps[11].at("val_loss"), trained.steps[5].at("val_loss") * 1.05);
  const std::string gen = bin("dtrain-gpt") + kGptShape + " --vocab-size 512 --resume " + ckpt + " --tokenizer " + dir +
                          "/tokenizer.model --max-new-tokens 20 --generate 'The licence' --seed ";
  auto a = run_command(gen + "1", 60), again = run_command(gen + "1", 60), other = run_command(gen + "2", 60);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_TRUE(contains(a.output, "The licence")) << a.output;
  EXPECT_EQ(a.output, again.output);  // (the seed decides the sample)
  EXPECT_NE(a.output, other.output);
  // Token files the model's vocabulary cannot hold, and token files without a vocabulary.
  auto small = run_command(bin("dtrain-gpt") + kGptShape + " --data " + dir + "/train --vocab-size 64 --steps 2 --batch-size 2", 60);
  EXPECT_NE(small.exit_code, 0);
  EXPECT_TRUE(contains(small.output, "outside the model's vocabulary of 64 (--vocab-size)")) << small.output;
  auto none = run_command(bin("dtrain-gpt") + kGptShape + " --data " + dir + "/train --steps 2", 60);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_TRUE(contains(none.output, "holds token files: give their tokenizer's --vocab-size")) << none.output;
}

TEST(Tokens, GenerateInBytesFromAnyPlan) {
  const std::string ckpt = temp_dir() + "/ck";
  const GptRun trained = run_program("dtrain-gpt", 2, std::string(kGptShape) + " --strategy single --tp 2 --steps 4 --save " + ckpt);
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string gen = bin("dtrain-gpt") + kGptShape + " --resume " + ckpt + " --max-new-tokens 16 --temperature 0 --generate ";
  auto greedy = run_command(gen + "'Permission is '", 60);
  ASSERT_EQ(greedy.exit_code, 0) << greedy.output;
  // The prompt, then 16 bytes, then the newline.
  const auto at = greedy.output.find("Permission is ");
  ASSERT_NE(at, std::string::npos) << greedy.output;
  EXPECT_GE(greedy.output.size() - at, 14u + 16u) << greedy.output;
  EXPECT_EQ(greedy.output, run_command(gen + "'Permission is '", 60).output);  // (greedy: no draw)
  auto no_ckpt = run_command(bin("dtrain-gpt") + kGptShape + " --generate hi", 30);
  EXPECT_NE(no_ckpt.exit_code, 0);
  EXPECT_TRUE(contains(no_ckpt.output, "--generate needs the model to continue from: --resume DIR")) << no_ckpt.output;
}
