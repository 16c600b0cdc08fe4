// bench/gpu_bench.py's plumbing on the CPU (its --device cpu smoke mode): dtrain and the PyTorch
// peer (bench/gpu_peer.py, Debian's python3-torch) train the same tiny GPT, the table comes out, and
// the first losses agree (same model, weights and data on both sides). The GPU run itself needs a
// GPU machine (scripts/gpu-check.sh --bench).
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "testing/testing.h"

using dtrain::testing::run_command;

TEST(GpuBench, CpuSmokeRunPrintsTheTableAndTheSameFirstLoss) {
  if (run_command("/usr/bin/python3 -c 'import torch' 2>&1", 60).exit_code != 0) {
    GTEST_SKIP() << "needs Debian's python3-torch (scripts/install-deps.sh --all)";
  }
  auto res = run_command("cd " + std::string(DTRAIN_SOURCE_DIR) +
                             " && /usr/bin/python3 bench/gpu_bench.py --device cpu --shapes tiny --steps 4 --warmup 1 "
                             "--repeats 1 --only 'dtrain single,pytorch single,dtrain ddp,pytorch ddp'",
                         280);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  EXPECT_NE(res.output.find("| dtrain ddp | 2 |"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("| pytorch ddp | 2 |"), std::string::npos) << res.output;
  std::smatch m;
  for (const char* pair : {"dtrain single / pytorch single", "dtrain ddp / pytorch ddp"}) {
    ASSERT_TRUE(std::regex_search(res.output, m, std::regex(std::string(pair) + ": tokens/s [0-9.]+x, first loss ([0-9.]+) vs ([0-9.]+)")))
        << res.output;
    EXPECT_EQ(m[1].str(), m[2].str()) << pair;
  }
}
