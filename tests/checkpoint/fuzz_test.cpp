// Builds and runs each libFuzzer target (fuzz/) for a bounded number of inputs under ASan + UBSan.
// Skipped where clang++ or its fuzzer runtime is missing (fuzz/run.sh exits 77).
#include <gtest/gtest.h>

#include <string>

#include "testing/testing.h"

namespace {

void run_fuzz_target(const std::string& target) {
  const std::string work = std::string(DTRAIN_BIN_DIR) + "/../fuzz-work";
  const auto r = dtrain::testing::run_command(
      "bash " + std::string(DTRAIN_SOURCE_DIR) + "/fuzz/run.sh " + work + " " + target + " 5000 2>&1", 240);
  if (r.exit_code == 77) GTEST_SKIP() << r.output;
  ASSERT_EQ(r.exit_code, 0) << r.output.substr(r.output.size() > 6000 ? r.output.size() - 6000 : 0);
  EXPECT_NE(r.output.find("Done 5000 runs"), std::string::npos) << r.output;
}

}  // namespace

TEST(Fuzz, SafetensorsHeaderParser) { run_fuzz_target("safetensors_header"); }
TEST(Fuzz, ManifestParser) { run_fuzz_target("manifest"); }
