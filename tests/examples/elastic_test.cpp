// dtrun --nnodes MIN:MAX (Design note [elastic membership], dtrain/launch/agent.h): two "nodes" on
// loopback (one dtrun each, one rank each) train the tiny GPT with a checkpoint every step. A node
// that dies is dropped and the other goes on alone; a node that starts later joins; either way the
// run's steps, as its metrics record them, are the uninterrupted run's: each step once, with its
// loss, and the final parameters, to 1e-5 (the data-parallel sums change order with the world).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "resume_testing.h"

namespace dtrain::testing {
namespace {

using resume::GptRun;

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

constexpr int kSteps = 12;
// The global batch fixed (8 samples: 2 x 4 at two ranks, 4 x 2 accumulated at one).
const std::string kArgs = std::string(resume::kTinyModel) + " --global-batch-size 8 --batch-size 4 --steps " +
                          std::to_string(kSteps);

// The worker: dtrain-gpt saving every step and resuming from its newest checkpoint, its metrics
// (rank 0's) in dir/m<restart>.jsonl (sh expands the restart count dtrun gives each round).
std::string worker(const std::string& dir) {
  return "sh -c 'exec " + bin("dtrain-gpt") + kArgs + " --save " + dir + "/ck --save-every 1 --resume " + dir +
         "/ck --metrics " + dir + "/m$TORCHELASTIC_RESTART_COUNT.jsonl'";
}

std::string node(int rank, int port, const std::string& flags, const std::string& dir) {
  return bin("dtrun") + " --nnodes 1:2 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port " + std::to_string(port) +
         " --rdzv-timeout 30 --heartbeat-timeout 5 " + flags + " --node-rank " + std::to_string(rank) + " " + worker(dir) +
         " > " + dir + "/n" + std::to_string(rank) + ".log 2>&1";
}

// Every step of `rounds` (the metrics of each round, in order) is the uninterrupted run's: a round
// that resumed starts after the newest checkpoint, which the round before it had reached; the
// final one ends the run; each step's loss and the final parameters as `full`'s.
void expect_one_run(const std::vector<GptRun>& rounds, const GptRun& full, const std::string& logs) {
  ASSERT_EQ(full.exit_code, 0) << full.output;
  ASSERT_EQ(full.steps.size(), static_cast<size_t>(kSteps));
  ASSERT_FALSE(rounds.empty()) << logs;
  int64_t next = 1;  // the first step not yet trained by the rounds so far
  for (size_t r = 0; r < rounds.size(); ++r) {
    const GptRun& round = rounds[r];
    ASSERT_FALSE(round.start.empty()) << "round " << r << "\n" << logs;
    const int64_t start = r == 0 ? 0 : static_cast<int64_t>(round.summary.count("start_step") ? round.summary.at("start_step") : -1);
    if (r > 0) EXPECT_LE(start + 1, next) << "round " << r << " skipped steps\n" << logs;
    for (const auto& step : round.steps) {
      const int64_t s = static_cast<int64_t>(step.at("step"));
      EXPECT_EQ(s, start + 1 + (&step - &round.steps.front())) << "round " << r << "\n" << logs;
      ASSERT_LE(s, kSteps);
      const double want = full.steps[static_cast<size_t>(s - 1)].at("loss");
      EXPECT_NEAR(step.at("loss"), want, 1e-5 * std::abs(want)) << "round " << r << " step " << s;
      next = std::max(next, s + 1);
    }
  }
  EXPECT_EQ(next, kSteps + 1) << logs;
  const GptRun& last = rounds.back();
  ASSERT_FALSE(last.summary.empty()) << logs;
  const double sq = full.summary.at("param_sq");
  EXPECT_NEAR(last.summary.at("param_checksum"), full.summary.at("param_checksum"), 1e-5 * sq);
  EXPECT_NEAR(last.summary.at("param_sq"), sq, 1e-5 * sq);
}

std::vector<GptRun> rounds_of(const std::string& dir) {
  std::vector<GptRun> out;
  for (int r = 0;; ++r) {
    const std::string text = read_text(dir + "/m" + std::to_string(r) + ".jsonl");
    if (text.empty()) break;
    out.push_back(resume::parse_metrics(text));
  }
  return out;
}

}  // namespace

// Node 1 dies (its dtrun and its rank, SIGKILL, at the start of step 6): node 0's rank fails in the
// step's collective, node 0 restarts alone (one node is enough: --nnodes 1:2) from the checkpoint
// of step 5 and ends the run, exit 0.
TEST(Elastic, ALostNodeIsDroppedAndTheRunGoesOnAsTheUninterruptedOne) {
  const std::string dir = temp_dir();
  const int port = free_port();
  const std::string flags = "--rdzv-last-call 2 --max-restarts 1";
  // (node 1 first: it waits for node 0's store, so both join round 0 within the last call)
  auto r = run_command("DTRAIN_TEST_FAIL_AT_STEP=6 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_KILLS=node " +
                           node(1, port, flags, dir) + " & p1=$!; sleep 0.2; " + node(0, port, flags, dir) +
                           "; echo node0_exit=$?; wait $p1; echo node1_exit=$?",
                       120);
  const std::string logs = r.output + "\nnode 0:\n" + read_text(dir + "/n0.log") + "\nnode 1:\n" + read_text(dir + "/n1.log");
  EXPECT_TRUE(has(r.output, "node0_exit=0")) << logs;
  EXPECT_TRUE(has(r.output, "node1_exit=137")) << logs;
  const std::string n0 = read_text(dir + "/n0.log");
  EXPECT_TRUE(has(n0, "round 0: node(s) 0, 1 (2 of 1..2)")) << logs;
  EXPECT_TRUE(has(n0, "round 1: node(s) 0 (1 of 1..2)")) << logs;
  const auto rounds = rounds_of(dir);
  ASSERT_EQ(rounds.size(), 2u) << logs;
  EXPECT_EQ(rounds[0].start.at("world_size"), 2);
  EXPECT_EQ(rounds[1].start.at("world_size"), 1);
  EXPECT_EQ(rounds[1].summary.at("start_step"), 5) << logs;
  expect_one_run(rounds, resume::gpt(1, kArgs), logs);
}

// Node 1's dtrun stops (SIGSTOP: its heartbeat ends, its rank trains on): node 0 drops it after
// --heartbeat-timeout as a restartable failure (MIN is 1), stops its own rank, restarts alone from
// the newest checkpoint and ends the run, exit 0. (The test then kills node 1.)
TEST(Elastic, ANodeWhoseDtrunStopsRespondingIsDroppedByItsHeartbeat) {
  const std::string dir = temp_dir();
  const int port = free_port();
  const std::string flags = "--rdzv-last-call 2 --max-restarts 1 --heartbeat-timeout 2";
  auto r = run_command("export DTRAIN_TEST_SLOW_STEP_MS=250; " + node(1, port, flags, dir) + " & p1=$!; sleep 0.2; " +
                           node(0, port, flags, dir) + " & p0=$!; " +
                           "for i in $(seq 600); do [ \"$(grep -c '\"step\": ' " + dir +
                           "/m0.jsonl 2>/dev/null)\" -ge 3 ] 2>/dev/null && break; sleep 0.05; done; kill -STOP $p1; " +
                           "wait $p0; echo node0_exit=$?; kill -KILL $p1; wait $p1",
                       120);
  const std::string logs = r.output + "\nnode 0:\n" + read_text(dir + "/n0.log") + "\nnode 1:\n" + read_text(dir + "/n1.log");
  EXPECT_TRUE(has(r.output, "node0_exit=0")) << logs;
  const std::string n0 = read_text(dir + "/n0.log");
  EXPECT_TRUE(has(n0, "the dtrun of node 1 stopped responding (no heartbeat for 2 s); going on with 1 node(s)")) << logs;
  EXPECT_TRUE(has(n0, "round 1: node(s) 0 (1 of 1..2)")) << logs;
  const auto rounds = rounds_of(dir);
  ASSERT_EQ(rounds.size(), 2u) << logs;
  EXPECT_EQ(rounds[1].start.at("world_size"), 1);
  expect_one_run(rounds, resume::gpt(1, kArgs), logs);
}

// Node 0 starts alone (round 0 at one rank); node 1 starts during the run: node 0 ends the round as
// a membership change (not counted: --max-restarts 0), both resume from the newest checkpoint at
// two ranks and end the run, exit 0.
TEST(Elastic, ANodeThatStartsLaterJoinsAndTheRunGoesOnAsTheUninterruptedOne) {
  const std::string dir = temp_dir();
  const int port = free_port();
  const std::string flags = "--rdzv-last-call 0.2 --max-restarts 0";
  auto r = run_command("export DTRAIN_TEST_SLOW_STEP_MS=250; " + node(0, port, flags, dir) + " & p0=$!; " +
                           "for i in $(seq 600); do [ \"$(grep -c '\"step\": ' " + dir +
                           "/m0.jsonl 2>/dev/null)\" -ge 3 ] 2>/dev/null && break; sleep 0.05; done; " +
                           node(1, port, flags, dir) + "; echo node1_exit=$?; wait $p0; echo node0_exit=$?",
                       120);
  const std::string logs = r.output + "\nnode 0:\n" + read_text(dir + "/n0.log") + "\nnode 1:\n" + read_text(dir + "/n1.log");
  EXPECT_TRUE(has(r.output, "node0_exit=0")) << logs;
  EXPECT_TRUE(has(r.output, "node1_exit=0")) << logs;
  const std::string n0 = read_text(dir + "/n0.log");
  EXPECT_TRUE(has(n0, "round 0: node(s) 0 (1 of 1..2)")) << logs;
  EXPECT_TRUE(has(n0, "1 node(s) asked to join")) << logs;
  EXPECT_TRUE(has(n0, "round 1: node(s) 0, 1 (2 of 1..2)")) << logs;
  const auto rounds = rounds_of(dir);
  ASSERT_EQ(rounds.size(), 2u) << logs;
  EXPECT_EQ(rounds[0].start.at("world_size"), 1);
  EXPECT_EQ(rounds[1].start.at("world_size"), 2);
  EXPECT_GE(rounds[1].summary.at("start_step"), 3) << logs;
  expect_one_run(rounds, resume::gpt(1, kArgs), logs);
}

}  // namespace dtrain::testing
