// The checkpoint commit's system calls in their order (docs/checkpoint.md, the atomic protocol):
// every file of a checkpoint and its temporary directory are fsynced before the rename that
// publishes the directory, the parent directory after it; `latest` likewise. SIGKILL keeps the page
// cache, so the crash tests cannot see a missing fsync (a power loss would): this test reads the
// calls themselves, under Debian's strace, from a real 2-rank save.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "testing/testing.h"

using dtrain::testing::bin;
using dtrain::testing::read_file;
using dtrain::testing::run_command;
using dtrain::testing::temp_dir;

namespace {

struct Call {
  std::string name;               // fsync, fdatasync, rename, renameat, renameat2
  std::vector<std::string> paths;  // fsync: the file's path; rename: from, to
};

// The calls strace -f -y wrote (one per line, "PID name(args) = 0"), successful ones only.
std::vector<Call> calls_in(const std::string& trace) {
  std::ifstream in(trace);
  std::vector<Call> out;
  const std::regex fsync_re(R"re((fsync|fdatasync)\(\d+<([^>]*)>\)\s+= 0)re");
  const std::regex rename_re(R"re((rename|renameat|renameat2)\((?:[^,]*, )?"([^"]*)", (?:[^,]*, )?"([^"]*)".*\)\s+= 0)re");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_search(line, m, fsync_re)) out.push_back({m[1], {m[2]}});
    else if (std::regex_search(line, m, rename_re)) out.push_back({m[1], {m[2], m[3]}});
  }
  return out;
}

// Index of the first call `pred` accepts, or -1.
template <class Pred>
long first(const std::vector<Call>& calls, Pred pred) {
  for (size_t i = 0; i < calls.size(); ++i) {
    if (pred(calls[i])) return static_cast<long>(i);
  }
  return -1;
}

long fsync_of(const std::vector<Call>& calls, const std::string& path) {
  return first(calls, [&](const Call& c) { return c.name.find("sync") != std::string::npos && c.paths[0] == path; });
}

}  // namespace

TEST(Commit, FsyncsEverythingBeforeTheRenameThatPublishesIt) {
  if (run_command("strace -V", 10).exit_code != 0) GTEST_SKIP() << "strace is not installed (scripts/install-deps.sh installs it)";
  const std::string dir = temp_dir(), root = dir + "/ck", trace = dir + "/trace";
  const auto res = run_command("strace -f -y -qq -o " + trace + " -e trace=fsync,fdatasync,rename,renameat,renameat2 " +
                                   bin("dtrun") + " --standalone --nproc-per-node 2 " + bin("dtrain-mlp") +
                                   " --steps 2 --threads 1 --save " + root,
                               180);
  ASSERT_EQ(res.exit_code, 0) << res.output;
  const std::vector<Call> calls = calls_in(trace);
  const std::string step_dir = root + "/" + read_file(root + "/latest");
  // The rename that publishes the checkpoint: a temporary directory of root onto step_dir.
  const long publish = first(calls, [&](const Call& c) { return c.name.rfind("rename", 0) == 0 && c.paths[1] == step_dir; });
  ASSERT_GE(publish, 0) << "no rename onto " << step_dir << " in " << trace;
  const std::string tmp_dir = calls[static_cast<size_t>(publish)].paths[0];
  EXPECT_NE(tmp_dir.find(".tmp-"), std::string::npos) << tmp_dir;
  // Every file the checkpoint holds, fsynced under its temporary directory's name before the rename.
  const auto listed = run_command("ls " + step_dir, 10);
  std::istringstream names(listed.output);
  int files = 0;
  for (std::string name; std::getline(names, name);) {
    if (name.empty()) continue;
    ++files;
    const long synced = fsync_of(calls, tmp_dir + "/" + name);
    EXPECT_GE(synced, 0) << name << " was never fsynced";
    EXPECT_LT(synced, publish) << name << " was fsynced after the rename that published it";
  }
  EXPECT_GE(files, 3) << listed.output;  // the manifest and one file per rank
  const long tmp_synced = fsync_of(calls, tmp_dir);
  EXPECT_GE(tmp_synced, 0) << "the temporary directory was never fsynced";
  EXPECT_LT(tmp_synced, publish) << "the temporary directory was fsynced after its rename";
  // The parent directory after the rename (the rename itself made durable)...
  const auto root_synced_after = [&](long after) {
    for (size_t i = static_cast<size_t>(after) + 1; i < calls.size(); ++i) {
      if (calls[i].name.find("sync") != std::string::npos && calls[i].paths[0] == root) return static_cast<long>(i);
    }
    return -1L;
  };
  const long root_synced = root_synced_after(publish);
  EXPECT_GT(root_synced, publish) << "root was not fsynced after the checkpoint's rename";
  // ...and `latest` written to a temporary file, fsynced, renamed after the checkpoint, root fsynced again.
  const long latest = first(calls, [&](const Call& c) { return c.name.rfind("rename", 0) == 0 && c.paths[1] == root + "/latest"; });
  ASSERT_GT(latest, publish) << "`latest` was not renamed into place after the checkpoint";
  const long latest_synced = fsync_of(calls, calls[static_cast<size_t>(latest)].paths[0]);
  EXPECT_GE(latest_synced, 0) << "`latest`'s temporary file was never fsynced";
  EXPECT_LT(latest_synced, latest);
  EXPECT_GT(root_synced_after(latest), latest) << "root was not fsynced after `latest`'s rename";
}
