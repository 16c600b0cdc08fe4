// Issue 15 (hardening) through the library loop (dtrain-mlp, dtrain-gpt, dtrun): checkpoints that
// never load wrong or restart silently, training that goes wrong stops, bad input refused.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <thread>
#include <string>

#include "dtrain/util/fs.h"
#include "resume_testing.h"

using dtrain::testing::bin;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;
using namespace dtrain::testing::resume;
namespace fs = dtrain::util::fs;

namespace {

constexpr const char* kHardeningMlp = " --hidden 24 --depth 2 --samples 256 --batch-size 4 --lr 3e-3 --threads 1";

GptRun hardening_mlp(int world, const std::string& args) { return run_program("dtrain-mlp", world, kHardeningMlp + args); }

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// Flips one byte in the middle of the first rank file of checkpoint `dir`.
void damage(const std::string& dir) {
  const std::string f = dir + "/rank-00000.safetensors";
  std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(io.good()) << f;
  io.seekg(0, std::ios::end);
  const auto size = static_cast<std::streamoff>(io.tellg());
  io.seekg(size - 5);
  char c = 0;
  io.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  io.seekp(size - 5);
  io.write(&c, 1);
}

}  // namespace

// A missing `latest` or a damaged newest checkpoint falls back to the newest valid one (never to
// step 0 over checkpoints on disk), and training continues to the uninterrupted run's parameters.
TEST(ResumeFallback, MissingLatestAndDamagedNewestResumeFromTheNewestValid) {
  const GptRun full = hardening_mlp(2, " --strategy ddp --steps 8");
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const std::string ck = temp_dir() + "/ck";
  const GptRun first = hardening_mlp(2, " --strategy ddp --steps 6 --save-every 2 --save " + ck);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_TRUE(fs::is_directory(ck + "/step-00000004"));
  ASSERT_TRUE(fs::is_directory(ck + "/step-00000006"));

  // 1. No `latest`: the newest committed directory (step 6), said, not "starting from step 0".
  ASSERT_EQ(fs::remove(ck + "/latest"), 0);
  GptRun rest = hardening_mlp(2, " --strategy ddp --steps 8 --resume " + ck);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_TRUE(has(rest.output, "no `latest` file; looking for the newest complete checkpoint")) << rest.output;
  EXPECT_TRUE(has(rest.output, "resumed from " + ck + "/step-00000006: step 6")) << rest.output;
  EXPECT_FALSE(has(rest.output, "starting from step 0")) << rest.output;
  EXPECT_NEAR(rest.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-6 * full.summary.at("param_sq"));

  // 2. The newest damaged (one flipped byte in a tensor file): step 4, naming the skipped one and why.
  const GptRun again = hardening_mlp(2, " --strategy ddp --steps 6 --save-every 2 --save " + ck);  // (rewrites 4 and 6)
  ASSERT_EQ(again.exit_code, 0) << again.output;
  damage(ck + "/step-00000006");
  rest = hardening_mlp(2, " --strategy ddp --steps 8 --resume " + ck);
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  EXPECT_TRUE(has(rest.output, "checkpoint " + ck + "/step-00000006 cannot be resumed from")) << rest.output;
  EXPECT_TRUE(has(rest.output, "does not match the manifest's sha256")) << rest.output;
  EXPECT_TRUE(has(rest.output, "skipped as damaged: " + ck + "/step-00000006")) << rest.output;
  EXPECT_TRUE(has(rest.output, "resumed from " + ck + "/step-00000004: step 4")) << rest.output;
  EXPECT_NEAR(rest.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-6 * full.summary.at("param_sq"));

  // 3. Every checkpoint damaged: an error, exit 1, not a silent start from step 0 over them.
  damage(ck + "/step-00000004");  // (step 6 is still damaged)
  rest = hardening_mlp(1, " --strategy single --batch-size 8 --steps 8 --resume " + ck);
  EXPECT_EQ(rest.exit_code, 1) << rest.output;
  EXPECT_TRUE(has(rest.output, "none of the 2 checkpoint(s) there is valid on every rank")) << rest.output;
  EXPECT_TRUE(rest.steps.empty());
  EXPECT_TRUE(fs::is_directory(ck + "/step-00000004")) << "nothing was overwritten";
}

// A changed learning rate on resume is applied and said, never silently replaced by the checkpoint's.
TEST(ResumeFallback, ADifferentLearningRateIsAppliedAndSaid) {
  const std::string ck = temp_dir() + "/ck";
  ASSERT_EQ(hardening_mlp(1, " --strategy single --steps 2 --save " + ck).exit_code, 0);
  const GptRun same = hardening_mlp(1, " --strategy single --steps 4 --resume " + ck);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_FALSE(has(same.output, "learning rate")) << same.output;
  const GptRun other = hardening_mlp(1, " --strategy single --steps 4 --lr 5e-3 --resume " + ck);
  ASSERT_EQ(other.exit_code, 0) << other.output;
  EXPECT_TRUE(has(other.output, "the checkpoint's learning rate (parameter group 0) is 0.003, this run's (--lr) "
                                     "is 0.005: training on with 0.005"))
      << other.output;
  EXPECT_NE(other.summary.at("param_checksum"), same.summary.at("param_checksum")) << "the new rate was used";
}

// A diverging run stops with exit 1 naming the step, at W=1 and W=2 (every rank alike, no hang).
TEST(Divergence, NonFiniteLossOrNormStopsTheRun) {
  for (int world : {1, 2}) {
    const std::string strategy = world == 1 ? " --strategy single" : " --strategy ddp";
    GptRun run = hardening_mlp(world, strategy + " --steps 40 --lr 1e12");
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_TRUE(has(run.output, ": training diverged; stopping (lower --lr")) << run.output;
    EXPECT_LT(run.steps.size(), 40u);
    run = hardening_mlp(world, strategy + " --steps 40 --lr 1e12 --clip-grad-norm 1");
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_TRUE(has(run.output, "is inf: training diverged") || has(run.output, "is nan: training diverged") ||
                has(run.output, "is -nan: training diverged"))
        << run.output;
    // With dynamic loss scaling a skipped step is normal (the step's gradients had inf/NaN), but
    // not --max-skipped-steps of them in a row; a non-finite loss stops at once.
    run = run_program("dtrain-mlp", world, kHardeningMlp + strategy + " --steps 40 --loss-scale dynamic --max-skipped-steps 3",
                      "DTRAIN_TEST_INF_GRAD_AT_STEP=2 DTRAIN_TEST_INF_GRAD_STEPS=100 ");
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_TRUE(has(run.output, "step 4: the last 3 steps were all skipped for inf/NaN gradients")) << run.output;
    run = run_program("dtrain-mlp", world, kHardeningMlp + strategy + " --steps 6 --loss-scale dynamic --max-skipped-steps 3",
                      "DTRAIN_TEST_INF_GRAD_AT_STEP=2 DTRAIN_TEST_INF_GRAD_STEPS=2 ");
    EXPECT_EQ(run.exit_code, 0) << "two in a row is below the limit\n" << run.output;
    run = hardening_mlp(world, strategy + " --steps 40 --lr 1e12 --loss-scale dynamic");
    EXPECT_EQ(run.exit_code, 1) << run.output;
    EXPECT_TRUE(has(run.output, ": training diverged; stopping")) << run.output;
  }
  const GptRun bad = hardening_mlp(1, " --strategy single --steps 2 --max-skipped-steps 3");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(has(bad.output, "--max-skipped-steps applies to --loss-scale dynamic")) << bad.output;
}

// --data that is not a regular file is refused before anything is read (a FIFO would block, a
// device never end); metrics carry no negative sizes.
TEST(BadInput, DataMustBeARegularFileAndSizesAreNeverNegative) {
  const std::string dir = temp_dir();
  const std::string fifo = dir + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& data : {fifo, std::string("/dev/zero")}) {
    auto res = run_command(bin("dtrain-gpt") + kTinyModel + " --steps 1 --data " + data, 60);
    EXPECT_EQ(res.exit_code, 1) << res.output;
    EXPECT_TRUE(has(res.output, "is not a regular file (" + std::string(data == fifo ? "a named pipe" : "a device") +
                                         "); pass a text file or a directory of text files"))
        << res.output;
  }
  const GptRun ddp = hardening_mlp(2, " --strategy ddp --steps 2");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  for (const auto& [k, v] : ddp.summary) {
    if (has(k, "mib") || has(k, "bytes")) EXPECT_GE(v, 0) << k;
  }
  EXPECT_EQ(ddp.summary.count("peak_owned_mib_per_rank"), 0u) << "not tracked by ddp: left out";
}

TEST(BadInput, DtrunRefusesMoreWorkersThanTheMachineCanRun) {
  auto res = run_command(bin("dtrun") + " --standalone --nproc-per-node 1000000 /bin/true", 30);
  EXPECT_EQ(res.exit_code, 2) << res.output;
  EXPECT_TRUE(has(res.output, "--nproc-per-node 1000000 is more than this machine can run")) << res.output;
}

// Two machines without GLOO_SOCKET_IFNAME (two network namespaces over a veth pair): each rank
// advertises the address that routes to MASTER_ADDR, says so, and the job equals the standalone
// run. Skipped, with the reason, where the machine does not let a test create namespaces.
TEST(MultiNode, TwoNamespacesWithoutNamingTheInterface) {
  const std::string out = temp_dir();
  auto res = run_command(std::string(DTRAIN_SOURCE_DIR) + "/tests/launch/scripts/two_nodes_netns.sh " +
                             dtrain::testing::bin("") + " " + out, 240);
  if (res.exit_code == 77) GTEST_SKIP() << res.output;
  ASSERT_EQ(res.exit_code, 0) << res.output;
  EXPECT_TRUE(has(res.output, "two-node ok")) << res.output;
  EXPECT_TRUE(has(res.output, "dtrain: gloo on this node uses 10.77.")) << res.output;
  EXPECT_TRUE(has(res.output, "(the address that routes to MASTER_ADDR 10.77.")) << res.output;
}

// Issue 15: SIGSTOP of a random rank of a 3-rank DDP run at a random moment, several trials: the
// job ends (exit 1) within --stall-timeout + 30 s, naming the stopped rank; never a hang.
TEST(Stall, RandomlyStoppedRankIsNamedEveryTime) {
  if (run_command("command -v pgrep", 5).exit_code != 0) GTEST_SKIP() << "no pgrep (procps) to find the workers";
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 2; ++trial) {  // (DtrunStall.AStoppedRankIsNamed: a fixed victim)
    const std::string dir = temp_dir();
    const std::string pid_file = dir + "/pid", rc_file = dir + "/rc", out = dir + "/out";
    run_command("sh -c '" + bin("dtrun") + " --standalone -n 3 --stall-timeout 3 --term-timeout 1 " + bin("dtrain-mlp") +
                    kHardeningMlp + " --strategy ddp --steps 1000000 > " + out + " 2>&1 & d=$!; echo $d > " + pid_file +
                    "; wait $d; echo $? > " + rc_file + "' > /dev/null 2>&1 &",
                10);
    std::string pid;
    for (int i = 0; i < 50 && pid.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::ifstream(pid_file) >> pid;
    }
    ASSERT_FALSE(pid.empty());
    std::this_thread::sleep_for(std::chrono::milliseconds(1500 + rng() % 2000));  // into training, at a random point
    const auto workers = run_command("pgrep -P " + pid + " -x dtrain-mlp", 10).output;
    std::vector<std::string> pids;
    std::istringstream in(workers);
    for (std::string p; in >> p;) pids.push_back(p);
    if (pids.size() != 3u) {
      run_command("kill -9 " + pid, 5);  // (never leave a 1,000,000-step job behind)
      FAIL() << "expected 3 workers of dtrun " << pid << ", found: " << workers;
    }
    const std::string victim = pids[rng() % 3];
    ASSERT_EQ(run_command("kill -STOP " + victim, 5).exit_code, 0);
    const auto t0 = std::chrono::steady_clock::now();
    std::string rc;
    while (rc.empty() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(33)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::ifstream(rc_file) >> rc;
    }
    std::ifstream o(out);
    const std::string text((std::istreambuf_iterator<char>(o)), std::istreambuf_iterator<char>());
    if (rc.empty()) {
      run_command("kill -9 " + pid + " " + victim, 5);  // (no hang of the test either)
      FAIL() << "trial " << trial << ": dtrun did not end within 3 + 30 s\n" << text;
    }
    EXPECT_EQ(rc, "1") << text;
    EXPECT_TRUE(std::regex_search(text, std::regex("rank [0-2] \\(pid " + victim + ", STOPPED"))) << text;
    EXPECT_TRUE(std::regex_search(text, std::regex("=> rank\\(s\\) [0-2] stopped \\(SIGSTOP or a debugger\\)"))) << text;
  }
}
