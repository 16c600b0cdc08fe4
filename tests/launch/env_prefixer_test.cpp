// The worker environment contract (a pure function) and the output prefixer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtrain/launch/env.h"
#include "dtrain/launch/prefixer.h"

namespace dtrain::launch {
namespace {

TEST(WorkerEnv, TorchrunContract) {
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.nnodes = 3;
  o.node_rank = 1;
  o.master_addr = "10.1.2.3";
  o.master_port = 29501;
  o.max_restarts = 4;
  o.run_id = "job42";
  EnvMap env = worker_env(o, /*local_rank=*/1, /*restart=*/2);
  const EnvMap expected{
      {"RANK", "3"},
      {"LOCAL_RANK", "1"},
      {"WORLD_SIZE", "6"},
      {"LOCAL_WORLD_SIZE", "2"},
      {"GROUP_RANK", "1"},
      {"GROUP_WORLD_SIZE", "3"},
      {"ROLE_RANK", "3"},
      {"ROLE_WORLD_SIZE", "6"},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", "10.1.2.3"},
      {"MASTER_PORT", "29501"},
      {"TORCHELASTIC_RESTART_COUNT", "2"},
      {"TORCHELASTIC_MAX_RESTARTS", "4"},
      {"TORCHELASTIC_RUN_ID", "job42"},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"DTRUN", "1"},
      {"DTRAIN_STDOUT_ISATTY", "0"},
  };
  EXPECT_EQ(env, expected);

  o.stdout_isatty = true;
  EXPECT_EQ(worker_env(o, 0, 0).at("DTRAIN_STDOUT_ISATTY"), "1");
  EXPECT_EQ(worker_env(o, 0, 0).at("RANK"), "2");
}

TEST(WorkerEnv, RejectsUnresolvedPortAndBadRank) {
  LaunchOptions o;
  o.nproc_per_node = 2;
  o.master_port = 0;
  EXPECT_THROW(worker_env(o, 0, 0), std::invalid_argument);
  o.master_port = 1000;
  EXPECT_THROW(worker_env(o, 2, 0), std::invalid_argument);
  EXPECT_NO_THROW(worker_env(o, 1, 0));
}

TEST(WorkerEnv, MergeOverridesAndKeepsTheRest) {
  auto merged = merge_env({"PATH=/bin", "RANK=9", "HOME=/root", "RANK=8"}, {{"RANK", "0"}, {"DTRUN", "1"}});
  EXPECT_EQ(merged, (std::vector<std::string>{"PATH=/bin", "RANK=0", "HOME=/root", "DTRUN=1"}));
}

struct Capture {
  std::vector<std::string> calls;
  OutputPrefixer::Sink sink() {
    return [this](std::string_view s) { calls.emplace_back(s); };
  }
  std::string joined() const {
    std::string all;
    for (auto& c : calls) all += c;
    return all;
  }
};

TEST(OutputPrefixer, WholeLines) {
  Capture c;
  OutputPrefixer p("[0]:", c.sink());
  p.feed("a\nbb\n");
  EXPECT_EQ(c.calls, (std::vector<std::string>{"[0]:a\n", "[0]:bb\n"}));
  p.feed("\n");
  EXPECT_EQ(c.calls.back(), "[0]:\n");
}

TEST(OutputPrefixer, PartialLinesAreHeldUntilComplete) {
  Capture c;
  OutputPrefixer p("[1]:", c.sink());
  p.feed("hel");
  EXPECT_TRUE(c.calls.empty());
  EXPECT_EQ(p.pending(), 3u);
  p.feed("lo wor");
  p.feed("ld\nnext");
  EXPECT_EQ(c.calls, (std::vector<std::string>{"[1]:hello world\n"}));
  p.finish();  // end of stream: the unfinished line gets a newline
  EXPECT_EQ(c.calls.back(), "[1]:next\n");
  p.finish();
  EXPECT_EQ(c.calls.size(), 2u);
}

TEST(OutputPrefixer, CarriageReturnProgressUpdates) {
  Capture c;
  OutputPrefixer p("[0]:", c.sink());
  p.feed("10%\r20%\r");
  EXPECT_EQ(c.calls, (std::vector<std::string>{"[0]:10%\r", "[0]:20%\r"}));
  p.feed("3");
  p.feed("0%\r100%\n");
  EXPECT_EQ(c.calls, (std::vector<std::string>{"[0]:10%\r", "[0]:20%\r", "[0]:30%\r", "[0]:100%\n"}));
}

TEST(OutputPrefixer, CrLfIsOneLineEnding) {
  Capture c;
  OutputPrefixer p("[0]:", c.sink());
  p.feed("a\r\nb\r");
  p.feed("\nc\n");
  EXPECT_EQ(c.joined(), "[0]:a\r\n[0]:b\r\n[0]:c\n");
  // tqdm style: "\r" first, then the text; a bare "\r" shows nothing.
  Capture t;
  OutputPrefixer q("[2]:", t.sink());
  q.feed("\r 1/3");
  q.feed("\r 2/3");
  q.feed("\r 3/3\n");
  EXPECT_EQ(t.calls, (std::vector<std::string>{"[2]: 1/3\r", "[2]: 2/3\r", "[2]: 3/3\n"}));
}

TEST(OutputPrefixer, InterleavedWorkersKeepLinesWhole) {
  Capture c;  // one shared sink, as dtrun's stdout
  OutputPrefixer a("[0]:", c.sink());
  OutputPrefixer b("[1]:", c.sink());
  a.feed("alpha ");
  b.feed("beta ");
  b.feed("two\nbeta three");
  a.feed("one\n");
  b.feed("\n");
  EXPECT_EQ(c.calls, (std::vector<std::string>{"[1]:beta two\n", "[0]:alpha one\n", "[1]:beta three\n"}));
}

TEST(OutputPrefixer, VeryLongLinesAreSplit) {
  Capture c;
  OutputPrefixer p("[0]:", c.sink());
  p.feed(std::string(OutputPrefixer::kMaxSegment + 10, 'x'));
  ASSERT_EQ(c.calls.size(), 1u);
  EXPECT_EQ(c.calls[0].size(), 4 + OutputPrefixer::kMaxSegment + 10 + 1);
  EXPECT_EQ(c.calls[0].back(), '\n');
}

TEST(OutputPrefixer, PrefixFormat) { EXPECT_EQ(output_prefix(12), "[12]:"); }

}  // namespace
}  // namespace dtrain::launch
