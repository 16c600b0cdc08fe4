// --save-async in the library loop (Design note [asynchronous saves], checkpoint/async_saver.h):
// its rank files are a synchronous save's byte for byte, a run resumes from them bit-exact at the
// same world size and, at another world size and strategy, exactly as from a synchronous save; the
// metrics carry each save's stall and each background write's time; a full disk stops the run with
// an error naming the rank, `latest` left on the last complete checkpoint, from which the run
// resumes. The saver's own tests (the copies, failures, one save in flight) are in
// tests/checkpoint/async_saver_test.cpp, crashes during background writes in crash_test.cpp.
#include <gtest/gtest.h>

#include <string>

#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;

namespace {

const std::string kArgs = " --strategy fsdp --batch-size 2 --steps 8 --clip-grad-norm 0.5";

std::string file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST(GptAsyncCheckpoint, FilesEqualSynchronousOnesAndResumeAnywhere) {
  const std::string sync_ck = temp_dir() + "/sync", async_ck = temp_dir() + "/async";
  const GptRun sync = gpt(2, kArgs + " --save " + sync_ck + " --save-every 3");
  const GptRun async = gpt(2, kArgs + " --save " + async_ck + " --save-every 3 --save-async");
  ASSERT_EQ(sync.exit_code, 0) << sync.output;
  ASSERT_EQ(async.exit_code, 0) << async.output;
  EXPECT_TRUE(contains(async.output, "the checkpoint of step 8 is written")) << async.output;
  for (const char* step : {"step-00000006", "step-00000008"}) {
    for (const char* rank : {"rank-00000.safetensors", "rank-00001.safetensors"}) {
      const std::string a = file(async_ck + "/" + step + "/" + rank);
      EXPECT_FALSE(a.empty()) << step << "/" << rank;
      EXPECT_TRUE(a == file(sync_ck + "/" + step + "/" + rank)) << step << "/" << rank << " differs";
    }
  }
  // Metrics: every save's stall and bytes at its step, each background write's time once it ended.
  int stalls = 0, writes = 0;
  for (const auto& s : async.steps) {
    const bool save_step = s.at("step") == 3 || s.at("step") == 6 || s.at("step") == 8;
    EXPECT_EQ(s.count("checkpoint_stall_s") == 1, save_step) << "step " << s.at("step");
    if (save_step) EXPECT_GT(s.at("checkpoint_mib"), 0.0);
    stalls += static_cast<int>(s.count("checkpoint_stall_s"));
    writes += static_cast<int>(s.count("checkpoint_write_s"));
    EXPECT_EQ(s.count("checkpoint_write_cpu_s"), s.count("checkpoint_write_s")) << "step " << s.at("step");
  }
  EXPECT_EQ(stalls, 3);
  EXPECT_GE(writes, 1);  // (the last one's ends after the last step: printed, not in a step's record)
  EXPECT_EQ(sync.steps[2].count("checkpoint_stall_s"), 1u);
  // Same world: bit-exact continuation; another world and strategy: as from the synchronous save.
  GptRun first = async;
  first.steps.resize(6);
  expect_continues(first, gpt(2, kArgs + " --resume " + async_ck + "/step-00000006"), async, 0);
  const std::string other = " --strategy single --batch-size 4 --steps 8 --clip-grad-norm 0.5";
  const GptRun from_async = gpt(1, other + " --resume " + async_ck + "/step-00000006");
  const GptRun from_sync = gpt(1, other + " --resume " + sync_ck + "/step-00000006");
  ASSERT_EQ(from_async.exit_code, 0) << from_async.output;
  ASSERT_EQ(from_async.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(from_async.steps[i].at("loss"), from_sync.steps[i].at("loss"));
  EXPECT_EQ(from_async.summary.at("param_checksum"), from_sync.summary.at("param_checksum"));
}

// A disk that fills up during a background write (a small tmpfs in a mount namespace of the
// test's own): the run stops non-zero with the error naming the rank, the step and the path;
// `latest` names the last complete checkpoint, nothing of the failed one is left, and the run
// resumes from it like the uninterrupted run.
TEST(GptAsyncCheckpoint, DiskFullStopsTheRunAndKeepsTheLastCheckpoint) {
  if (run_command("unshare -m sh -c 'mount -t tmpfs -o size=64k dtrain-test " + temp_dir() + "'").exit_code != 0) {
    GTEST_SKIP() << "needs mount namespaces (root)";
  }
  const std::string ck = temp_dir(), out = temp_dir();
  const std::string args = kTinyModel + std::string(" --strategy fsdp --batch-size 2 --steps 12");
  const std::string gpt_cmd = bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-gpt") + args;
  // Each checkpoint of this model takes about 400 KiB: two fit in 1000 KiB, a third does not.
  const auto res = run_command(
      "unshare -m sh -c 'mount -t tmpfs -o size=1000k dtrain-test " + ck + " || exit 99; " + gpt_cmd + " --save " + ck +
          " --save-every 3 --save-async > " + out + "/first.txt 2>&1; echo \"first exit $?\"; echo \"latest $(cat " + ck +
          "/latest)\"; ls " + ck + "; " + gpt_cmd + " --resume " + ck + " --metrics " + out + "/rest.jsonl > " + out +
          "/rest.txt 2>&1; echo \"rest exit $?\"'",
      240);
  const std::string first = file(out + "/first.txt");
  ASSERT_TRUE(contains(res.output, "first exit ")) << res.output;
  ASSERT_FALSE(contains(res.output, "first exit 0")) << res.output << first;
  for (const char* rank : {"[rank 0]: error: rank 0: ", "[rank 1]: error: rank 1: "}) {  // both stop with it
    EXPECT_TRUE(contains(first, std::string(rank) + "the asynchronous checkpoint of step 9 failed in the background"))
        << first;
  }
  EXPECT_TRUE(contains(first, "No space left on device")) << first;
  EXPECT_TRUE(contains(first, "checkpoint save of step 9 to " + ck)) << first;
  EXPECT_TRUE(contains(res.output, "latest step-00000006")) << res.output;
  EXPECT_FALSE(contains(res.output, "step-00000009")) << res.output;
  EXPECT_FALSE(contains(res.output, ".tmp-")) << res.output;
  ASSERT_TRUE(contains(res.output, "rest exit 0")) << res.output << file(out + "/rest.txt");
  // The resumed steps 7..12 are the uninterrupted run's.
  const GptRun full = gpt(2, " --strategy fsdp --batch-size 2 --steps 12");
  std::vector<double> rest;
  std::stringstream lines(file(out + "/rest.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    const auto f = numeric_fields(line);
    if (f.count("step") && f.count("loss")) rest.push_back(f.at("loss"));
  }
  ASSERT_EQ(rest.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(rest[i], full.steps[6 + i].at("loss")) << "step " << 7 + i;
}

// --snapshot-every (Design note [partner snapshots]): a run that hands its state to partners every
// 2 steps trains exactly as one that does not, and says what each snapshot took. (Rebuilding a
// checkpoint from the survivors is tests/checkpoint/partner_snapshot_test.cpp.)
TEST(GptPartnerSnapshots, SnapshotsChangeNothingAndAreTimed) {
  const GptRun plain = gpt(2, kArgs);
  const GptRun snapped = gpt(2, kArgs + " --snapshot-every 2");
  ASSERT_EQ(snapped.exit_code, 0) << snapped.output;
  ASSERT_EQ(snapped.steps.size(), plain.steps.size());
  for (size_t i = 0; i < plain.steps.size(); ++i) {
    EXPECT_EQ(snapped.steps[i].at("loss"), plain.steps[i].at("loss")) << "step " << i + 1;
    EXPECT_EQ(snapped.steps[i].count("snapshot_s"), (i + 1) % 2 == 0 ? 1u : 0u) << "step " << i + 1;
  }
  EXPECT_EQ(snapped.summary.at("param_checksum"), plain.summary.at("param_checksum"));
}
