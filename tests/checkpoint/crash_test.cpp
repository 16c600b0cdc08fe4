// Crash safety: a process saving checkpoints in a loop is SIGKILLed at random moments (and at
// each named point of the commit); afterwards `latest` always opens, validates and holds exactly
// what was saved for its step, and so does every committed step directory.
//
// The saving process is this test binary itself, re-executed to run only the disabled
// CrashWorker.DISABLED_SaveLoop test (a fresh process, not a fork of a multi-threaded one).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <random>
#include <regex>
#include <thread>

#include <ATen/ATen.h>

#include "checkpoint_testing.h"
#include "dtrain/checkpoint/async_saver.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

using namespace dtrain;
using namespace dtrain::checkpoint;
namespace fs = dtrain::util::fs;

namespace {

constexpr int64_t kNumel = 1 << 18;  // 1 MiB of float per checkpoint

// What the worker saves at `step`: values that encode the step.
at::Tensor weights_at(int64_t step) { return at::arange(kNumel, at::kFloat) + static_cast<float>(step * 1000); }

// Checks that the checkpoint in `dir` is complete and holds step `expect_step`'s values.
void expect_valid(const std::string& dir) {
  const Reader r = Reader::open(dir);
  const int64_t step = r.step();
  ASSERT_EQ(r.metadata().at("step"), std::to_string(step)) << dir;
  EXPECT_TRUE(at::equal(r.read("model/w"), weights_at(step))) << dir;
  EXPECT_EQ(r.read("meta/step").item<int64_t>(), step) << dir;
  EXPECT_EQ(r.keys().size(), 2u) << dir;
}

// Starts the worker on `root`; `crash_at` is DTRAIN_CHECKPOINT_CRASH_AT ("" for none); `async`:
// it saves through an AsyncSaver (the commit runs in its background thread).
pid_t start_worker(const std::string& root, int64_t last_step, const std::string& crash_at, bool async = false) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string s = *e;
    if (s.rfind("DTRAIN_CKPT_WORKER_", 0) != 0 && s.rfind("DTRAIN_CHECKPOINT_CRASH_AT=", 0) != 0) env_strings.push_back(s);
  }
  env_strings.push_back("DTRAIN_CKPT_WORKER_ROOT=" + root);
  env_strings.push_back("DTRAIN_CKPT_WORKER_LAST_STEP=" + std::to_string(last_step));
  if (!crash_at.empty()) env_strings.push_back("DTRAIN_CHECKPOINT_CRASH_AT=" + crash_at);
  if (async) env_strings.push_back("DTRAIN_CKPT_WORKER_ASYNC=1");
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = fs::read_symlink("/proc/self/exe").value();
  std::string filter = "--gtest_filter=CrashWorker.DISABLED_SaveLoop";
  std::string disabled = "--gtest_also_run_disabled_tests";
  std::vector<char*> argv{exe.data(), filter.data(), disabled.data(), nullptr};
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int devnull = ::open("/dev/null", O_WRONLY);
    if (devnull >= 0) ::dup2(devnull, STDOUT_FILENO);
    ::execve(exe.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

std::vector<std::string> committed_dirs(const std::string& root) {
  std::vector<std::string> out;
  static const std::regex re("step-[0-9]+");
  for (const auto& name : fs::list_directory(root)) {
    if (std::regex_match(name, re)) out.push_back(fs::join(root, name));
  }
  return out;
}

}  // namespace

// Not a test on its own: the process the crash tests start and kill. Saves steps
// latest + 1, latest + 2, ... up to DTRAIN_CKPT_WORKER_LAST_STEP with 2 ranks.
TEST(CrashWorker, DISABLED_SaveLoop) {
  const char* root_env = std::getenv("DTRAIN_CKPT_WORKER_ROOT");
  if (!root_env) GTEST_SKIP() << "started by the crash tests only";
  const std::string root = root_env;
  const int64_t last = std::stoll(std::getenv("DTRAIN_CKPT_WORKER_LAST_STEP"));
  int64_t first = 1;
  if (auto dir = latest(root)) first = Reader::open(*dir).step() + 1;
  const bool async = std::getenv("DTRAIN_CKPT_WORKER_ASYNC") != nullptr;
  dtrain::testing::run_ranks(2, [&](comm::ProcessGroup& pg) {
    std::unique_ptr<AsyncSaver> saver;
    if (async) saver = std::make_unique<AsyncSaver>(pg, SaveOptions().keep_last(3));
    for (int64_t step = first; step <= last; ++step) {
      std::vector<Piece> pieces{*replicated_piece("model/w", weights_at(step), pg.rank(), 2)};
      if (pg.rank() == 1) pieces.push_back(whole_piece("meta/step", at::scalar_tensor(step, at::kLong)));
      if (saver) {
        saver->save(root, step, pieces, {{"step", std::to_string(step)}});
      } else {
        save(root, step, pg, pieces, {{"step", std::to_string(step)}}, SaveOptions().keep_last(3));
      }
    }
    if (saver) saver->wait();
  }, 60000);
}

namespace {

void killed_at_random_moments(bool async, int iterations) {
  const std::string root = dtrain::testing::temp_dir();
  std::mt19937 gen(12345);
  std::uniform_int_distribution<int> delay_ms(0, 150);  // a save takes ~10 ms: kills land anywhere in it
  int64_t last_seen = 0;
  int kills = 0, mid_save = 0;
  for (int iteration = 0; iteration < iterations; ++iteration) {
    const pid_t pid = start_worker(root, 1000000, "", async);
    ASSERT_GT(pid, 0);
    // Wait until the worker is in its saving loop (it has committed a step after the last one
    // seen), however slowly it starts on a loaded machine; then kill it at a random moment.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < give_up) {
      const std::string text = dtrain::checkpoint::testing::read_bytes(root + "/latest");
      if (!text.empty() && std::stoll(text.substr(5)) > last_seen) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(gen)));
    ::kill(pid, SIGKILL);
    const int status = wait_exit(pid);
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) ++kills;
    for (const auto& name : fs::list_directory(root)) {
      if (name.find(".tmp-") != std::string::npos) {
        ++mid_save;  // killed inside a save (its temporary directory is left)
        break;
      }
    }
    auto dir = latest(root);
    if (!dir) continue;  // killed before the first commit
    expect_valid(*dir);
    const int64_t step = Reader::open(*dir).step();
    EXPECT_GE(step, last_seen) << "latest went backwards";
    last_seen = step;
    for (const auto& d : committed_dirs(root)) expect_valid(d);
  }
  EXPECT_EQ(kills, iterations) << "the worker should still have been saving when killed";
  std::cout << "[ info ] " << kills << " kills, " << mid_save << " after a save had begun, last step " << last_seen << "\n";
  EXPECT_GE(last_seen, iterations) << "every iteration should have committed at least one checkpoint";
  // A clean run afterwards cleans the leftovers of the killed saves up.
  ASSERT_EQ(wait_exit(start_worker(root, last_seen + 1, "", async)), 0);
  for (const auto& name : fs::list_directory(root)) {
    EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
  }
  expect_valid(root);
}

}  // namespace

TEST(Crash, KilledAtRandomMomentsLatestIsAlwaysACompleteCheckpoint) { killed_at_random_moments(false, 8); }

// The same with the saves written in the background (checkpoint::AsyncSaver): kills land in the
// copy, in the background write and in its commit.
TEST(Crash, AsyncSavesKilledAtRandomMomentsLatestIsAlwaysComplete) { killed_at_random_moments(true, 4); }

TEST(Crash, AtEachPointOfTheCommitSynchronousAndAsync) {
  struct Case {
    const char* point;
    int64_t latest_after;    // what latest names after the crash during the save of step 2
    bool step2_dir_complete;  // whether step-00000002 exists (committed but perhaps not named)
  };
  // (the async saver runs the same commit in its thread: two of the points suffice for it)
  for (const bool async : {false, true})
  for (const Case c : {Case{"before-manifest", 1, false}, Case{"before-rename", 1, false},
                       Case{"after-rename", 1, true}, Case{"after-latest", 2, true}}) {
    if (async && (std::string(c.point) == "before-manifest" || std::string(c.point) == "after-latest")) continue;
    SCOPED_TRACE(std::string(c.point) + (async ? " (async)" : ""));
    const std::string root = dtrain::testing::temp_dir();
    const int status = wait_exit(start_worker(root, 2, std::string(c.point) + ":2", async));
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    ASSERT_TRUE(latest(root));
    EXPECT_EQ(Reader::open(root).step(), c.latest_after);
    expect_valid(root);
    EXPECT_EQ(fs::exists(root + "/step-00000002"), c.step2_dir_complete);
    if (c.step2_dir_complete) expect_valid(root + "/step-00000002");
    // The run resumes: saving step 2 (again) and 3 works and cleans up.
    ASSERT_EQ(wait_exit(start_worker(root, 3, "", async)), 0);
    EXPECT_EQ(Reader::open(root).step(), 3);
    for (const auto& d : committed_dirs(root)) expect_valid(d);
    for (const auto& name : fs::list_directory(root)) {
      EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
    }
  }
}
