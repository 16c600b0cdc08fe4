// dtrain-gpt end to end, in real processes started by dtrun: DDP on W ranks with per-rank batch B
// trains exactly like one process with batch W*B (world sizes 1, 2, 3).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>

#include "testing/testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;

namespace {

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

double number(const std::string& line, const std::string& key) {
  std::smatch m;
  std::regex re("\"" + key + "\": (-?[0-9.eE+-]+)");
  if (!std::regex_search(line, m, re)) throw std::runtime_error("no numeric field " + key + " in " + line);
  return std::stod(m[1]);
}

struct TrainingRun {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // with --clip-grad-norm
  double checksum = 0, sq = 0;
  std::string final_line;
};

const char* kDemoModel = " --layers 2 --d-model 32 --heads 2 --seq-len 32 --steps 10 --lr 3e-3 --threads 1";

TrainingRun train(int world, const std::string& args) {
  const std::string metrics = temp_dir() + "/metrics.jsonl";
  std::string cmd = world == 1 ? bin("dtrain-gpt") : bin("dtrun") + " --standalone --nproc-per-node " +
                                                         std::to_string(world) + " " + bin("dtrain-gpt");
  auto res = run_command(cmd + kDemoModel + args + " --metrics " + metrics, 120);
  EXPECT_EQ(res.exit_code, 0) << res.output;
  TrainingRun run;
  for (const auto& line : lines_of(metrics)) {
    if (line.find("\"start\": true") != std::string::npos) continue;  // (the plan and its batch)
    if (line.find("\"final\": true") != std::string::npos) {
      run.final_line = line;
      run.checksum = number(line, "param_checksum");
      run.sq = number(line, "param_sq");
    } else {
      run.losses.push_back(number(line, "loss"));
      if (line.find("grad_norm") != std::string::npos) run.grad_norms.push_back(number(line, "grad_norm"));
    }
  }
  return run;
}

void expect_same_training(const TrainingRun& a, const TrainingRun& b, double tol) {
  ASSERT_EQ(a.losses.size(), 10u);
  ASSERT_EQ(b.losses.size(), 10u);
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_NEAR(a.losses[i], b.losses[i], tol * std::abs(b.losses[i])) << "step " << i + 1;
  }
  EXPECT_NEAR(a.sq, b.sq, tol * std::abs(b.sq));
  EXPECT_NEAR(a.checksum, b.checksum, tol * std::abs(b.sq));  // sum of squares as the scale
  EXPECT_GT(a.losses.front(), a.losses.back());                 // it learns
}

}  // namespace

class GptDemoParity : public ::testing::TestWithParam<int> {};

TEST_P(GptDemoParity, DdpEqualsOneProcessWithTheGlobalBatch) {
  const int W = GetParam();
  TrainingRun single = train(1, " --strategy single --batch-size " + std::to_string(2 * W));
  TrainingRun ddp = train(W, " --strategy ddp --batch-size 2 --optimizer adamw");
  expect_same_training(ddp, single, 1e-5);
}

TEST_P(GptDemoParity, GradientAccumulationWithSgd) {
  const int W = GetParam();
  TrainingRun single = train(1, " --strategy single --optimizer sgd --batch-size " + std::to_string(2 * W));
  TrainingRun ddp = train(W, " --strategy ddp --optimizer sgd --batch-size 1 --grad-accum 2");
  expect_same_training(ddp, single, 1e-5);
}

// ZeRO-1 and ZeRO-2 train exactly like one process too, with global-norm clipping on.
TEST_P(GptDemoParity, ShardedStrategiesWithClipping) {
  const int W = GetParam();
  for (const std::string opt : {"adamw", "sgd"}) {
    TrainingRun single = train(1, " --strategy single --clip-grad-norm 0.5 --optimizer " + opt + " --batch-size " +
                                      std::to_string(2 * W));
    for (const std::string strategy : {"zero1", "zero2"}) {
      TrainingRun sharded = train(W, " --strategy " + strategy + " --clip-grad-norm 0.5 --optimizer " + opt +
                                         " --batch-size 2");
      SCOPED_TRACE(strategy + " " + opt);
      expect_same_training(sharded, single, 1e-5);
      ASSERT_EQ(sharded.grad_norms.size(), single.grad_norms.size());
      for (size_t i = 0; i < single.grad_norms.size(); ++i) {
        EXPECT_NEAR(sharded.grad_norms[i], single.grad_norms[i], 1e-5 * single.grad_norms[i]) << "step " << i + 1;
      }
      // The clipping really acts: some steps' global norm is above the limit.
      EXPECT_GT(*std::max_element(single.grad_norms.begin(), single.grad_norms.end()), 0.5);
    }
  }
}

// Recomputing activations changes nothing numerically (also under DDP); bf16 autocast tracks fp32.
TEST_P(GptDemoParity, ActivationCheckpointingAndBf16) {
  const int W = GetParam();
  TrainingRun single = train(1, " --strategy single --batch-size " + std::to_string(2 * W));
  TrainingRun ckpt = train(W, " --strategy ddp --activation-checkpointing --batch-size 2");
  expect_same_training(ckpt, single, 1e-5);
  TrainingRun bf16 = train(W, " --strategy ddp --precision bf16 --batch-size 2");
  ASSERT_EQ(bf16.losses.size(), single.losses.size());
  for (size_t i = 0; i < single.losses.size(); ++i) {
    EXPECT_NEAR(bf16.losses[i], single.losses[i], 0.02 * single.losses[i]) << "step " << i + 1;
  }
  EXPECT_GT(bf16.losses.front(), bf16.losses.back());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GptDemoParity, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(GptDemo, MetricsHaveTheDocumentedFields) {
  TrainingRun run = train(2, " --batch-size 2");
  for (const char* key : {"param_checksum", "param_sq", "tokens_per_s", "world_size"}) {
    EXPECT_NO_THROW(number(run.final_line, key)) << key;
  }
  EXPECT_NE(run.final_line.find("\"peak_rss_mib_per_rank\": ["), std::string::npos) << run.final_line;
  EXPECT_EQ(number(run.final_line, "world_size"), 2);
  // No mfu without a known peak, no GPU fields on the CPU.
  EXPECT_EQ(run.final_line.find("mfu"), std::string::npos) << run.final_line;
  EXPECT_EQ(run.final_line.find("peak_gpu_mib"), std::string::npos) << run.final_line;
}

TEST(GptDemo, MfuFromThePeakAndTheModelsFlops) {
  // tiny model (layers 2, d 32, vocab 256, mlp 4, T 32): matmul parameters 2 x 12,704 + 64 + 8,192
  // = 33,664, so 6 x 33,664 + 12 x 2 x 32 x 32 = 226,560 FLOPs per token.
  TrainingRun run = train(2, " --batch-size 2 --peak-tflops 0.5 --attention math");
  EXPECT_EQ(number(run.final_line, "flops_per_token"), 226560);
  EXPECT_EQ(number(run.final_line, "peak_tflops"), 0.5);
  const double expected = number(run.final_line, "tokens_per_s") * 226560 / (0.5e12 * 2);
  EXPECT_NEAR(number(run.final_line, "mfu"), expected, 1e-6 * expected);
  auto res = run_command(bin("dtrain-gpt") + " --peak-tflops 0", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("--peak-tflops expects a positive number"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-gpt") + " --attention flash", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("--attention must be fused or math"), std::string::npos) << res.output;
}

// tokens_per_s against a count of the test's own: samples x tokens per sample x steps over the wall
// time the test measures. Two runs of N and N + 120 steps: the difference of their wall times is the
// 120 steps' time without the start-up, so (120 x global batch x T) / that difference is the rate the
// reported figure must agree with (within noise: the metric leaves out each step's bookkeeping, so
// it is the higher one). Fails if tokens_per_s is divided (or multiplied) by the world size.
TEST(Metrics, TokensPerSecondAgreesWithAnIndependentCount) {
  constexpr int kWorld = 2, kBatch = 4, kSeq = 64, kShort = 10, kExtra = 120;
  auto wall_and_rate = [&](int steps) {
    const std::string metrics = temp_dir() + "/metrics.jsonl";
    const auto t0 = std::chrono::steady_clock::now();
    auto res = run_command(bin("dtrun") + " --standalone --nproc-per-node " + std::to_string(kWorld) + " " +
                           bin("dtrain-gpt") + " --layers 2 --d-model 128 --heads 4 --threads 1 --seq-len " +
                           std::to_string(kSeq) + " --batch-size " + std::to_string(kBatch) + " --steps " +
                           std::to_string(steps) + " --metrics " + metrics, 180);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(res.exit_code, 0) << res.output;
    double rate = -1;
    for (const auto& line : lines_of(metrics)) {
      if (line.find("\"final\": true") != std::string::npos) rate = number(line, "tokens_per_s");
    }
    return std::make_pair(wall, rate);
  };
  const auto [short_wall, short_rate] = wall_and_rate(kShort);
  const auto [long_wall, long_rate] = wall_and_rate(kShort + kExtra);
  ASSERT_GT(long_wall, short_wall);
  const double independent = double(kExtra) * kWorld * kBatch * kSeq / (long_wall - short_wall);
  std::printf("tokens/s: reported %.0f, counted %.0f (%.2fx)\n", long_rate, independent, long_rate / independent);
  EXPECT_GT(long_rate, 0.6 * independent) << "reported " << long_rate << " tokens/s, counted " << independent;
  EXPECT_LT(long_rate, 1.6 * independent) << "reported " << long_rate << " tokens/s, counted " << independent;
  EXPECT_GT(short_rate, 0.0);
}

TEST(GptDemo, BadInputIsAClearError) {
  auto res = run_command(bin("dtrain-gpt") + " --strategy zero9", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("--strategy must be single, dp, ddp, zero1, zero2, fsdp, hsdp or auto"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-gpt") + " --d-model 30 --heads 4", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("divisible by --heads"), std::string::npos) << res.output;
  res = run_command(bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-gpt") + " --strategy single" +
                        kDemoModel, 60);
  EXPECT_NE(res.exit_code, 0);
  EXPECT_NE(res.output.find("--strategy single trains one replica on 1 rank(s), but WORLD_SIZE is 2"), std::string::npos)
      << res.output;
  res = run_command(bin("dtrain-gpt") + " --data /nonexistent/corpus" + kDemoModel, 30);
  EXPECT_EQ(res.exit_code, 1);
  EXPECT_NE(res.output.find("/nonexistent/corpus"), std::string::npos) << res.output;
  // FSDP flags: a bad value, a flag for another strategy, a layout that does not fit the world.
  res = run_command(bin("dtrain-gpt") + " --strategy fsdp --sharding half", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("--sharding must be full, grad_op, none or hybrid"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-gpt") + " --strategy ddp --sharding full", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("apply to --strategy fsdp or hsdp"), std::string::npos) << res.output;
  res = run_command(bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-gpt") +
                        " --strategy hsdp --shard-size 3" + kDemoModel, 60);
  EXPECT_NE(res.exit_code, 0);
  EXPECT_NE(res.output.find("the shard group of 3 rank(s) (--shard-size) must divide the 2 data-parallel rank(s)"),
            std::string::npos) << res.output;
}

TEST(GptDemo, FsdpBackwardScheduleFlags) {
  // The lean schedule trains like the default one (the schedule moves collectives, not values);
  // bad values and flags for other strategies are errors.
  const auto lean = train(2, " --strategy fsdp --backward-prefetch after --overlap-reduction off --max-gathered-units 1");
  expect_same_training(lean, train(2, " --strategy fsdp"), 1e-5);
  auto res = run_command(bin("dtrain-gpt") + " --strategy fsdp --backward-prefetch later", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("--backward-prefetch must be before, after or none"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-gpt") + " --strategy hsdp --overlap-reduction no", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("--overlap-reduction must be on or off"), std::string::npos) << res.output;
  res = run_command(bin("dtrain-gpt") + " --strategy zero2 --backward-prefetch after", 30);
  EXPECT_EQ(res.exit_code, 2);
  EXPECT_NE(res.output.find("apply to --strategy fsdp or hsdp"), std::string::npos) << res.output;
}
