// In-process recovery (Design note [in-process recovery], dtrain/train/elastic.h): under
// `dtrun --keep-survivors`, `--elastic` DDP runs lose ranks (SIGKILL at a random moment of a step,
// or one after the other) and the survivors go on in their processes at the smaller world size,
// same global batch. Each run must be the uninterrupted run: every step once, in order, with its
// loss, and the final parameters, to 1e-5 (the data-parallel sums change order with the world);
// the recovery takes well under the collective timeout (the watcher aborts the waits), and dtrun
// ends 0 naming the rank lost. Sharded state (zero1, zero2, fsdp with --snapshot-every 1) rolls
// back to the partner snapshots and redoes the steps since: each step's last record counts, and the
// redone records are exactly those the regroups announce. The bad cases end with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/checkpoint/store.h"
#include "dtrain/train/tensorboard.h"
#include "dtrain/util/fs.h"
#include "recovery_testing.h"
#include "resume_testing.h"

namespace dtrain::testing::in_process {
namespace {

using recovery::expect_sizes;
using recovery::expect_uninterrupted;
using recovery::expect_same_training;
using recovery::has;
using recovery::last_records;
using recovery::random_kill;
using recovery::recovery_records;
using resume::GptRun;

// 12 samples a step: 3 ranks x 2 x 2 accumulated, 2 x 2 x 3, 4 x 1 x 3.
constexpr const char* kArgs = " --global-batch-size 12 --batch-size 2 --steps 10 --collective-timeout 60";

GptRun elastic_gpt(int world, const std::string& env, const std::string& args = kArgs) {
  return resume::gpt(world, args + std::string(" --elastic"), env, " --keep-survivors");
}

// The bytes per rank of each "--memory-budget: ... needs N bytes per rank" line (Design note
// [memory plan], membership changes), in order: one per generation.
std::vector<int64_t> budget_lines(const std::string& output) {
  std::vector<int64_t> out;
  const std::string key = " needs ";
  for (size_t at = output.find("--memory-budget: "); at != std::string::npos; at = output.find("--memory-budget: ", at + 1)) {
    const size_t n = output.find(key, at);
    if (n != std::string::npos) out.push_back(std::stoll(output.substr(n + key.size())));
  }
  return out;
}

// The world size after each regroup, in order.
TEST(InProcessRecovery, ARankStuckInComputeIsWaitedForOrLeftOut) {
  // No progress within --collective-timeout (3 s): rank 1 stops at step 4, alive, its sockets
  // open (DTRAIN_TEST_FAIL_KILLS=stall:S). Stuck 4 s: the others' all-reduce times out and it comes
  // back within --elastic-join-timeout (3 s): all three regroup and go on. (A timeout's diagnosis
  // that went on waiting once the job was aborted made the others late to the regroup, and the
  // stuck rank went on alone, leaving them out.) Stuck 12 s: the others go on without it; back, it
  // finds itself left out and ends 1, one more rank lost on the way (dtrun ends 0). Either way
  // equal to the uninterrupted run.
  const GptRun full = resume::gpt(3, kArgs);
  const std::string args = " --global-batch-size 12 --batch-size 2 --steps 10 --collective-timeout 3 --elastic-join-timeout 3";
  const std::string stall = "DTRAIN_TEST_FAIL_AT_STEP=4 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_KILLS=stall:";
  const GptRun back = elastic_gpt(3, stall + "4 ", args);
  expect_same_training(back, full, 3, 1);
  EXPECT_FALSE(has(back.output, "left out")) << back.output;
  const GptRun left = elastic_gpt(3, stall + "12 ", args);
  expect_same_training(left, full, 2, 1);
  // (its end, after the others finished or while they run, is one more lost on the way)
  EXPECT_TRUE(has(left.output, "the surviving workers exited 0 (lost on the way: rank(s) 1)")) << left.output;
  EXPECT_TRUE(has(left.output, "rank 1 was left out of generation 1 (members: ranks 0, 2 of the first generation)")) << left.output;
}

TEST(InProcessRecovery, ARankKilledAtARandomMomentCostsOnlyItsStep) {
  const GptRun full = resume::gpt(3, kArgs);
  std::mt19937 draw(std::random_device{}());
  for (int victim : {2, 0}) {  // (rank 0 too: the metrics move to the new rank 0)
    const int step = std::uniform_int_distribution<int>(2, 8)(draw);
    const int ms = std::uniform_int_distribution<int>(0, 25)(draw);
    const std::string env = "DTRAIN_TEST_FAIL_AT_STEP=" + std::to_string(step) + " DTRAIN_TEST_FAIL_RANK=" +
                            std::to_string(victim) + " DTRAIN_TEST_FAIL_AFTER_MS=" + std::to_string(ms) + " ";
    SCOPED_TRACE(env);  // (the moment drawn: rerun with it to reproduce)
    const std::string board = temp_dir();
    const GptRun run = elastic_gpt(3, env, std::string(kArgs) + " --tensorboard " + board);
    expect_uninterrupted(run, full, 2, 1);
    // TensorBoard: every step's loss once across the directory's event files (a new rank 0 writes
    // its own file beside the lost one's)
    std::vector<int64_t> steps;
    for (const auto& file : util::fs::list_directory(board)) {
      for (const auto& e : train::read_scalar_events(util::fs::join(board, file))) {
        if (e.tag == "train/loss") steps.push_back(e.step);
      }
    }
    std::sort(steps.begin(), steps.end());
    std::vector<int64_t> every(10);
    for (int i = 0; i < 10; ++i) every[i] = i + 1;
    EXPECT_EQ(steps, every) << run.output;
    EXPECT_TRUE(has(run.output, "worker rank " + std::to_string(victim) + " (local " + std::to_string(victim)))
        << run.output;
  }
}

TEST(InProcessRecovery, ARankLostAtTheVoteDropsTheStepEverywhere) {
  // The lost rank did its part of the step's collectives and died before voting: the others'
  // collectives succeeded, and only the vote keeps them from stepping the optimizer (then redoing
  // the step after the regroup would step twice).
  const GptRun run = elastic_gpt(3, "DTRAIN_TEST_FAIL_AT_STEP=5 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_WHERE=vote ");
  expect_uninterrupted(run, resume::gpt(3, kArgs), 2, 1);
  EXPECT_EQ(run.regroups[0].at("from_step"), 5.0);
}

TEST(InProcessRecovery, ARankLostDuringASaveLeavesTheCheckpointsWhole) {
  // The step was committed; the save's collectives fail on the survivors, who go on from the next
  // step. The newest complete checkpoint is the run's last, and the one after the failure resumes.
  // With --save-async the survivors' background save of step 5 is cut (not committed) and a new
  // saver writes the new generation's checkpoints.
  const GptRun full = resume::gpt(3, kArgs);
  for (const std::string mode : {"", " --save-async"}) {
    SCOPED_TRACE(mode);
    const std::string dir = temp_dir() + "/ck";
    const GptRun run = elastic_gpt(3, "DTRAIN_TEST_FAIL_AT_STEP=5 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_WHERE=save ",
                                   std::string(kArgs) + " --save " + dir + " --save-every 1" + mode);
    expect_uninterrupted(run, full, 2, 1);
    EXPECT_EQ(run.regroups[0].at("from_step"), 6.0);  // (step 5 stepped everywhere: not redone)
    EXPECT_EQ(checkpoint::Reader::open(dir).step(), 10);
    const GptRun rest = resume::gpt(2, std::string(kArgs) + " --steps 12 --resume " + dir);
    ASSERT_EQ(rest.exit_code, 0) << rest.output;
    EXPECT_EQ(rest.summary.at("start_step"), 10.0);
  }
  // Around pipeline stages (4 ranks, 2 replicas x 2 stages, Design note [whole units]): a rank lost
  // as the save (ddp) or the evaluation (fsdp) begins, whose collectives run after the vote; its
  // unit (ranks 1, 3) leaves, the other goes on at 2 ranks (ddp: from its own state; fsdp: rolled
  // back to the snapshots).
  for (const std::string plan : {" --strategy ddp", " --strategy fsdp --snapshot-every 1"}) {
    SCOPED_TRACE(plan);
    const std::string args = std::string(kArgs) + " --pp 2 --layers 2" + plan, dir = temp_dir() + "/ck";
    const bool eval = has(plan, "fsdp");
    const std::string held_out = eval ? " --val-fraction 0.1" : "";  // (the same training data in both runs)
    const GptRun run = resume::gpt(4, args + held_out + " --elastic --save " + dir + " --save-every 1" + (eval ? " --eval-every 1" : ""),
                                   std::string("DTRAIN_TEST_FAIL_AT_STEP=5 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_WHERE=") +
                                       (eval ? "eval " : "save "),
                                   " --keep-survivors");
    expect_uninterrupted(run, resume::gpt(4, std::string(kArgs) + " --pp 2 --layers 2" + held_out), 2, 1);  // (ddp's: the same training)
    EXPECT_TRUE(has(run.output, "lost on the way: rank(s) 1, 3")) << run.output;
    EXPECT_EQ(checkpoint::Reader::open(dir).step(), 10);
  }
}

TEST(InProcessRecovery, TwoRanksLostOneAfterTheOther) {
  // Four ranks: Gloo's ring leaves some survivors waiting on a live peer; the watcher aborts them.
  // (micro-batches of 3 x 1 at four ranks, 2 x 2 at three, 3 x 2 at two)
  const std::string args = " --global-batch-size 12 --batch-size 3 --steps 10 --collective-timeout 60";
  const GptRun run = elastic_gpt(4, "DTRAIN_TEST_FAILS=3@2,7@1 ", args);
  expect_uninterrupted(run, resume::gpt(4, args), 2, 2);
  expect_sizes(run, {3, 2});
  EXPECT_EQ(run.regroups[0].at("from_step"), 3.0);
  EXPECT_EQ(run.regroups[1].at("from_step"), 7.0);
}

TEST(InProcessRecovery, ReplacementsJoinAndTheRunGrowsBack) {
  // dtrun starts a process in each lost rank's place (--max-restarts); it joins at a step boundary
  // and takes the step, the optimizer state and the parameters from the live ranks. The first
  // replacement (id 3) is lost too, 3 steps after it joined. (Slow steps: a process takes ~1 s to start.)
  const std::string args = " --global-batch-size 12 --batch-size 2 --steps 50 --collective-timeout 60";
  const GptRun run = resume::gpt(3, args + " --elastic", "DTRAIN_TEST_SLOW_STEP_MS=100 DTRAIN_TEST_FAILS=4@2,3@3 ",
                                 " --keep-survivors --max-restarts 2");
  ASSERT_GE(run.regroups.size(), 3u) << run.output;
  expect_uninterrupted(run, resume::gpt(3, args), run.regroups.size() == 4 ? 3 : 2, run.regroups.size());
  const std::vector<double> sizes{2, 3, 2, 3};  // (the last regroup only when the second replacement came in time)
  expect_sizes(run, {sizes.begin(), sizes.begin() + std::min<size_t>(run.regroups.size(), sizes.size())});
  EXPECT_TRUE(has(run.output, "starting rank 3 (local 2) in rank 2's place")) << run.output;
  EXPECT_TRUE(has(run.output, "starting rank 4 (local 2) in rank 3's place")) << run.output;
}

TEST(InProcessRecovery, WithSnapshotSyncOnlyTheStepInFlightIsRedone) {
  // ZeRO-2 at 3 ranks, --snapshot-every 1; rank 1 lost as step 4's partner snapshot begins (after
  // its optimizer step). Overlapped (the default), the others record step 4 and begin step 5 while
  // the exchange goes on; step 4's snapshots are not everywhere, so they roll back to step 3's and
  // step 4 is recorded again: a committed step redone besides the one in flight. --snapshot-sync:
  // step 4's record waits until its snapshots are everywhere, so the failure is found within step
  // 4, the step in flight, and no step is recorded twice (Design note [sharded state in process]).
  const GptRun full = resume::gpt(3, kArgs);
  const std::string env = "DTRAIN_TEST_FAIL_AT_STEP=4 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_WHERE=snapshot ";
  for (const bool sync : {false, true}) {
    SCOPED_TRACE(sync ? "--snapshot-sync" : "overlapped");
    const GptRun run = elastic_gpt(3, env, std::string(kArgs) + " --strategy zero2 --snapshot-every 1" + (sync ? " --snapshot-sync" : ""));
    expect_uninterrupted(run, full, 2, 1);
    size_t recorded_again = 0;
    last_records(run, recorded_again);
    EXPECT_EQ(run.regroups.at(0).at("from_step"), 4.0) << run.output;  // (step 3's snapshots)
    EXPECT_EQ(recorded_again, sync ? 0u : 1u) << run.output;
  }
}

TEST(InProcessRecovery, ShardedStateRollsBackToThePartnerSnapshots) {
  // ZeRO-2, ZeRO-1 and FSDP: a lost rank's part of the optimizer state (and FSDP's of the
  // parameters) is on no other rank but in its partner snapshot. The survivors roll back to the
  // newest step whose snapshots they hold together, re-split it over two ranks from memory and
  // redo the steps since: with --snapshot-every 1 at most the committed step before the one in
  // flight (when the failure cut its snapshot's exchange); ZeRO-1 snapshots every 2 steps and loses
  // its rank in a step after an odd count, so exactly one committed step is redone.
  // (the uninterrupted run: DDP's, which every one of them trains to within 1e-5)
  const GptRun full = resume::gpt(3, kArgs);
  std::mt19937 draw(std::random_device{}());
  std::vector<int64_t> needs;  // (--memory-budget's counts, at 3 and at 2 ranks)
  for (const auto& [strategy, every] : std::vector<std::pair<std::string, int>>{{"zero2", 1}, {"zero1", 2}, {"fsdp", 1}}) {
    const std::string args = std::string(kArgs) + " --strategy " + strategy;
    const int victim = strategy == "zero1" ? 0 : strategy == "zero2" ? 1 : 2;
    // (ZeRO-1: the hook's step N is 1-based and the rank dies as step N begins, after N - 1
    // committed ones; the others at a random moment, which may be after the step's commit)
    const int step = every == 2 ? 2 * std::uniform_int_distribution<int>(2, 4)(draw) : std::uniform_int_distribution<int>(2, 8)(draw);
    const std::string ms = every == 2 ? "" : " DTRAIN_TEST_FAIL_AFTER_MS=" + std::to_string(std::uniform_int_distribution<int>(0, 25)(draw));
    const std::string env = "DTRAIN_TEST_FAIL_AT_STEP=" + std::to_string(step) + " DTRAIN_TEST_FAIL_RANK=" +
                            std::to_string(victim) + ms + " ";
    SCOPED_TRACE(strategy + ": " + env);
    // (FSDP with --memory-budget: each generation's plan counted against it, the measuring pass
    // leaving no trace in the training; the counts are kept for the budget case below)
    const std::string budget = strategy == "fsdp" ? " --memory-budget 4GiB" : "";
    const GptRun run = elastic_gpt(3, env, args + " --snapshot-every " + std::to_string(every) + budget);
    expect_uninterrupted(run, full, 2, 1);
    if (every == 2) {
      EXPECT_EQ(run.regroups[0].at("redone_steps"), 1.0) << run.output;  // (the snapshots of the step before)
    } else {
      EXPECT_LE(run.regroups[0].at("redone_steps"), 1.0) << run.output;
    }
    if (!budget.empty()) needs = budget_lines(run.output);
  }
  // Design note [memory plan], membership changes: FSDP's shards grow from 1/3 to 1/2 of the state
  // when a rank is lost; with a budget between the two counts the run starts (it fits at 3) and,
  // losing rank 1, every survivor stops with the reason instead of going on at 2 ranks.
  ASSERT_EQ(needs.size(), 2u) << "the counts at 3 and at 2 ranks";
  EXPECT_GT(needs[1], needs[0]) << "the shards grow when a rank is lost";
  const int64_t between = (needs[0] + needs[1]) / 2;
  const GptRun tight = elastic_gpt(3, "DTRAIN_TEST_FAIL_AT_STEP=3 DTRAIN_TEST_FAIL_RANK=1 ",
                                   std::string(kArgs) + " --strategy fsdp --snapshot-every 1 --memory-budget " + std::to_string(between));
  EXPECT_NE(tight.exit_code, 0) << tight.output;
  EXPECT_TRUE(has(tight.output, "--elastic: at 2 rank(s) fsdp needs")) << tight.output;
  EXPECT_TRUE(has(tight.output, "the job stops here rather than run out of memory")) << tight.output;
  EXPECT_GE(tight.steps.size(), 2u) << "it fitted at 3 ranks\n" << tight.output;
}

TEST(InProcessRecovery, UnevenSharesOfTheGlobalBatchTrainAsOneProcess) {
  // A global batch of 10 over 4 ranks (3, 3, 2, 2 samples: two micro-batches of up to 2 each, the
  // last two ranks' second one empty, run with weight 0) and, once a rank is lost, over 3 (4, 3,
  // 3): each micro-batch's loss weighted by its samples, the run equals one process (Design note
  // [the global batch]), under DDP and FSDP (whose reduce-scatter averages as DDP's all-reduce).
  // (with an evaluation every 3 steps, dealt as the steps are: the same forwards on every rank)
  const std::string args = " --global-batch-size 10 --batch-size 2 --steps 8 --collective-timeout 60 --eval-every 3"
                           " --val-fraction 0.1 --eval-batches 2";
  const GptRun one = resume::gpt(1, args);
  for (const std::string strategy : {"ddp", "fsdp"}) {
    SCOPED_TRACE(strategy);
    const GptRun run = elastic_gpt(4, "DTRAIN_TEST_FAIL_AT_STEP=4 DTRAIN_TEST_FAIL_RANK=1 ",
                                   args + " --strategy " + strategy + (strategy == "fsdp" ? " --snapshot-every 1" : ""));
    expect_uninterrupted(run, one, 3, 1);
    size_t redone = 0, evaluated = 0;
    const auto steps = last_records(run, redone);
    for (size_t i = 0; i < steps.size() && i < one.steps.size(); ++i) {
      if (!one.steps[i].count("val_loss")) continue;
      ++evaluated;
      ASSERT_TRUE(steps[i].count("val_loss")) << "step " << i + 1;
      EXPECT_NEAR(steps[i].at("val_loss"), one.steps[i].at("val_loss"), 1e-5 * one.steps[i].at("val_loss")) << "step " << i + 1;
    }
    EXPECT_EQ(evaluated, 3u);  // (steps 3, 6 and the last)
    EXPECT_EQ(run.start.at("micro_batch"), 2.0);
    EXPECT_EQ(run.start.at("accumulation"), 2.0);
  }
}

TEST(InProcessRecovery, TheLossScalerGoesOnAsInTheUninterruptedRun) {
  // Dynamic loss scaling (fp32: what is checked is the scaler's state and decisions), growing every
  // 2 good steps; +inf in a gradient at step 3 (skipped, the scale halved). ZeRO-2 snapshots every 2
  // steps and loses rank 1 as step 6 begins: the state and the scaler roll back to step 4's
  // snapshots and step 5 is redone (with the scale of then); a replacement joins and takes the
  // scaler from rank 0. Every step's loss, scale and skip are the uninterrupted run's.
  const std::string args = " --global-batch-size 12 --batch-size 2 --steps 40 --collective-timeout 60 --strategy zero2"
                           " --loss-scale dynamic --loss-scale-growth-interval 2";
  const std::string inf = "DTRAIN_TEST_INF_GRAD_AT_STEP=3 DTRAIN_TEST_INF_GRAD_RANK=0 ";
  const GptRun full = resume::gpt(3, args, inf);
  const GptRun run = resume::gpt(3, args + " --elastic --snapshot-every 2",
                                 inf + "DTRAIN_TEST_SLOW_STEP_MS=100 DTRAIN_TEST_FAILS=6@1 ", " --keep-survivors --max-restarts 1");
  ASSERT_GE(run.regroups.size(), 1u) << run.output;
  expect_uninterrupted(run, full, run.regroups.size() == 2 ? 3 : 2, run.regroups.size());
  EXPECT_EQ(run.regroups[0].at("redone_steps"), 1.0) << run.output;
  size_t redone = 0;
  const auto steps = last_records(run, redone);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].at("loss_scale"), full.steps[i].at("loss_scale")) << "step " << i + 1 << "\n" << run.output;
    EXPECT_EQ(steps[i].at("skipped"), full.steps[i].at("skipped")) << "step " << i + 1;
  }
  EXPECT_EQ(full.steps.at(2).at("skipped"), 1.0);  // (the hook's step)
  EXPECT_TRUE(has(run.output, "starting rank 3 (local 1) in rank 1's place")) << run.output;
}

TEST(InProcessRecovery, ARankLostInsideTheRecoveryIsRecoveredFrom) {
  // ZeRO-2 at four ranks: rank 3 dies at step 3; inside that recovery, once the survivors' state is
  // re-split over three and before their first snapshot, rank 1 dies too. The retry rolls back to
  // the snapshots from before the recovery (kept until it completes: rank 1's part is held by
  // rank 2, rank 3's by rank 0) and goes on at two ranks.
  const std::string args = " --global-batch-size 12 --batch-size 3 --steps 10 --collective-timeout 60 --strategy zero2";
  const GptRun run = elastic_gpt(4, "DTRAIN_TEST_FAILS=3@3,3@1:regroup ", args + " --snapshot-every 1");
  expect_uninterrupted(run, resume::gpt(4, args), 2, 2);
  expect_sizes(run, {3, 2});
}

TEST(InProcessRecovery, AReplacementReceivesItsShardFromTheLiveRanks) {
  // FSDP grows back: the replacement's shards of the parameters and optimizer state are re-split
  // from the live ranks' memory at a step boundary (nothing redone), no checkpoint on disk; the
  // members' module is wrapped again on the new group. (50 slow steps: a replacement takes 1-3 s to
  // start on a loaded machine, and must arrive before the last step; 30 were once too few in CI's
  // conditions.)
  const std::string args = " --global-batch-size 12 --batch-size 2 --steps 50 --collective-timeout 60 --strategy fsdp";
  const GptRun run = resume::gpt(3, args + " --elastic --snapshot-every 1", "DTRAIN_TEST_SLOW_STEP_MS=100 DTRAIN_TEST_FAILS=4@2 ",
                                 " --keep-survivors --max-restarts 1");
  ASSERT_EQ(run.regroups.size(), 2u) << run.output;
  expect_uninterrupted(run, resume::gpt(3, args), 3, 2);
  EXPECT_EQ(run.regroups[1].at("world_size"), 3.0);
  EXPECT_EQ(run.regroups[1].at("redone_steps"), 0.0);
}

TEST(InProcessRecovery, AUnitThatLostARankLeavesWholeAndReplacementsRefillIt) {
  // Design note [whole units] (train/elastic.h): HSDP (replicate 2 x shard 2), DDP around two
  // pipeline stages (2 replicas x 2 stages) and DDP of tensor-parallel pairs (2 x tensor 2: the
  // surviving pair's layers go on over its re-pointed tensor group), four ranks; a random rank is SIGKILLed at a random
  // moment of a random step. Its unit's other rank leaves too, the other unit goes on at 2 ranks
  // from the state it holds (nothing redone, no partner snapshot), and the two replacements dtrun
  // starts join as a unit: 4 ranks again, equal to the uninterrupted run.
  std::mt19937 draw(std::random_device{}());
  for (const std::string plan : {" --strategy hsdp --shard-size 2", " --strategy ddp --pp 2 --layers 2", " --strategy ddp --tp 2"}) {
    const std::string args = " --global-batch-size 8 --batch-size 2 --steps 40 --collective-timeout 60" + plan;
    const auto [victim, env] = random_kill(draw, 4, 2, 6);
    SCOPED_TRACE(plan + ", " + env);  // (the moment drawn: rerun with it to reproduce)
    const GptRun run = resume::gpt(4, args + " --elastic", env, " --keep-survivors --max-restarts 2");
    ASSERT_EQ(run.regroups.size(), 2u) << run.output;
    expect_uninterrupted(run, resume::gpt(4, args), 4, 2);
    expect_sizes(run, {2, 4});
    for (const auto& r : run.regroups) EXPECT_EQ(r.at("redone_steps"), 0.0) << run.output;
    // The partner of the victim in its unit: HSDP's shard group and the tensor group (ranks 0-1,
    // 2-3), a pipeline replica's other stage (ranks r and 2 + r).
    const int partner = plan.find("--pp") == std::string::npos ? victim ^ 1 : (victim + 2) % 4;
    EXPECT_TRUE(has(run.output, "rank " + std::to_string(partner) + " leaves the job at generation 1: its unit of 2 ranks "
                                "(one whole replica of the model) lost rank(s) " + std::to_string(victim)))
        << run.output;
    EXPECT_TRUE(has(run.output, "lost on the way: rank(s) " + std::to_string(victim) + ", " + std::to_string(partner)))
        << run.output;
  }
}

TEST(InProcessRecovery, ShardedUnitsComeWholeAndRollBackToTheSnapshots) {
  // FSDP and ZeRO-1 around two pipeline stages (2 replicas x 2 stages), FSDP and ZeRO-2 of
  // tensor-parallel pairs (2 x tensor 2), four ranks: the members come in whole units (a pipeline
  // replica, a tensor group: the degree must divide the world), but each unit's state is split
  // over the data-parallel ranks, so no unit holds a whole copy: each rank's partner snapshot is
  // kept in the other unit (Design note [whole units], train/elastic.h). A random rank is
  // SIGKILLed at a random moment of a random step; its unit leaves, the other rolls back to the
  // snapshots and goes on at 2 ranks (a tensor pair over its re-pointed group), two replacements
  // refill the lost unit; equal to the uninterrupted run (each step's last record).
  std::mt19937 draw(std::random_device{}());
  for (const std::string plan : {" --strategy fsdp --pp 2 --layers 2", " --strategy zero1 --pp 2 --layers 2",
                                 " --strategy fsdp --tp 2", " --strategy zero2 --tp 2"}) {
    const std::string args = " --global-batch-size 8 --batch-size 2 --steps 24 --collective-timeout 60" + plan;
    const auto [victim, env] = random_kill(draw, 4, 2, 6);
    SCOPED_TRACE(plan + ", " + env);  // (the moment drawn: rerun with it to reproduce)
    const GptRun run = resume::gpt(4, args + " --elastic --snapshot-every 1", env, " --keep-survivors --max-restarts 2");
    expect_uninterrupted(run, resume::gpt(4, args), 4, 2);
    expect_sizes(run, {2, 4});
    // (its replica's other stage; its tensor pair's other rank)
    const int partner = has(plan, "--pp") ? (victim + 2) % 4 : victim ^ 1;
    EXPECT_TRUE(has(run.output, "lost on the way: rank(s) " + std::to_string(victim) + ", " + std::to_string(partner)))
        << run.output;
  }
  // Two "nodes" (a dtrun each, on loopback), a stage a node: a partner a node away would be in the
  // same unit (ranks r and r + 2), lost with it; the partner is in the other unit instead
  // (train::snapshot_stride). Rank 1 is SIGKILLed at step 4; node 0's rank 0 and node 1's rank 2
  // go on.
  const std::string dir = temp_dir(), port = std::to_string(free_port());
  const std::string args = " --global-batch-size 8 --batch-size 2 --steps 10 --collective-timeout 60"
                           " --strategy fsdp --pp 2 --layers 2";
  auto node = [&](int k) {
    return "DTRAIN_TEST_FAIL_AT_STEP=4 DTRAIN_TEST_FAIL_RANK=1 " + bin("dtrun") + " --nnodes 2 --nproc-per-node 2 --node-rank " +
           std::to_string(k) + " --master-addr 127.0.0.1 --master-port " + port +
           " --heartbeat-timeout 3 --rdzv-timeout 30 --keep-survivors " + bin("dtrain-gpt") + resume::kTinyModel + args +
           " --elastic --snapshot-every 1" + (k == 0 ? " --metrics " + dir + "/m.jsonl" : "") + " > " + dir + "/n" +
           std::to_string(k) + ".log 2>&1";
  };
  const auto res = run_command(node(1) + " & p1=$!; " + node(0) + "; echo node0_exit=$?; wait $p1; echo node1_exit=$?", 120);
  GptRun run = resume::parse_metrics(read_file(dir + "/m.jsonl"));
  run.exit_code = has(res.output, "node0_exit=0") ? 0 : 1;
  run.output = res.output + "\nnode 0:\n" + read_file(dir + "/n0.log") + "\nnode 1:\n" + read_file(dir + "/n1.log");
  expect_uninterrupted(run, resume::gpt(4, args), 2, 1);
  EXPECT_TRUE(has(res.output, "node1_exit=0")) << run.output;  // (its rank 2 survived: every surviving dtrun ends 0)
  // (the survivors, one a node, each the other's partner now: the generation's first snapshots cross)
  const auto moved = recovery_records(run);
  ASSERT_EQ(moved.size(), 1u) << run.output;
  EXPECT_GT(moved[0].at("recovery_mib_across_nodes"), 0.0) << run.output;
}

TEST(InProcessRecovery, UnitsOfFourLeaveWholeAndAreRefilled) {
  // 8 ranks in units of 4 (Design note [whole units]): ZeRO-1 of two pipelines of two stages whose
  // layers are tensor-parallel pairs (a unit: the ranks of one data-parallel index, (r / 2) % 2;
  // each rank's partner snapshot kept in the other unit, the state rolled back to them),
  // HSDP (replicate 2 x shard 2) of tensor-parallel pairs (a unit: one shard group's pairs, r / 4)
  // and HSDP around two pipeline stages (a unit: one shard group of each stage, (r % 4) / 2). A
  // random rank is SIGKILLed at a random moment of a random step. The job's abort signal ends
  // every wait of the lost unit's ranks, pipeline transfers included (Design note [aborting a
  // group's waits], comm/abort.h), so the recovery stays far below the 30-s join timeout; the other
  // unit goes on at 4 ranks (over its re-pointed tensor groups), four replacements refill the lost
  // unit, and the run equals the uninterrupted one.
  std::mt19937 draw(std::random_device{}());
  const std::vector<std::pair<std::string, int (*)(int)>> plans{
      {" --strategy zero1 --tp 2 --pp 2 --layers 2 --snapshot-every 1", [](int r) { return (r / 2) % 2; }},
      {" --strategy hsdp --shard-size 2 --tp 2", [](int r) { return r / 4; }},
      {" --strategy hsdp --shard-size 2 --pp 2 --layers 2", [](int r) { return (r % 4) / 2; }}};
  for (const auto& [plan, unit_of] : plans) {
    // (30 steps: four replacement processes start while the survivors train, slowly on a loaded machine)
    const std::string args = " --global-batch-size 8 --batch-size 2 --steps 30 --collective-timeout 60" + plan;
    const auto [victim, env] = random_kill(draw, 8, 2, 5);
    SCOPED_TRACE(plan + ", " + env);  // (the moment drawn: rerun with it to reproduce)
    const GptRun run = resume::gpt(8, args + " --elastic", env, " --keep-survivors --max-restarts 4");
    expect_uninterrupted(run, resume::gpt(8, args), 8, 2);
    expect_sizes(run, {4, 8});
    const std::string said = "lost on the way: rank(s)";
    const size_t lost = run.output.find(said);
    ASSERT_NE(lost, std::string::npos) << run.output;
    const std::string names = run.output.substr(lost, run.output.find(')', lost + said.size()) - lost);
    for (int r = 0; r < 8; ++r) {
      const bool mate = unit_of(r) == unit_of(victim);
      EXPECT_EQ(has(names + ",", " " + std::to_string(r) + ","), mate) << "rank " << r << " in: " << names;
    }
  }
}

// Node 1 lost, node 0's two ranks go on: the recovery moved state between them (DDP's parameters
// broadcast, the sharded state re-split, the generation's first snapshots), none across nodes.
void expect_moved_within_node_0(const GptRun& run) {
  const auto moved = recovery_records(run);
  ASSERT_EQ(moved.size(), 1u) << run.output;
  EXPECT_GT(moved[0].at("recovery_mib"), 0.0) << run.output;
  EXPECT_EQ(moved[0].at("recovery_mib_across_nodes"), 0.0) << run.output;
}

TEST(InProcessRecovery, ANodeLostTheOtherGoesOn) {
  // Two "nodes" on loopback (a dtrun each, two ranks each); at a random moment of step 6 node 1's
  // dtrun is SIGKILLed (its workers die with it). Node 0's two ranks go on at half the size; its
  // dtrun ends 0. DDP; ZeRO-1, ZeRO-2 and FSDP: node 1's shards are in node 0's memory (the partner
  // snapshots' stride is a node); HSDP (its shard group a node: Design note [whole units]): node
  // 0's replica goes on alone. Node 0's dtrun names the ranks it declared dead.
  // The five plans run at once (their steps mostly sleep), each on its own port.
  std::mt19937 draw(std::random_device{}());
  const GptRun full = resume::gpt(4, " --global-batch-size 12 --batch-size 3 --steps 10 --collective-timeout 60");
  const std::vector<std::string> plans{" --strategy ddp", " --strategy zero1 --snapshot-every 1", " --strategy fsdp --snapshot-every 1",
                                       " --strategy zero2 --snapshot-every 1", " --strategy hsdp"};
  std::vector<std::string> dirs, moments;
  std::string all;
  for (const std::string& plan : plans) {
    moments.push_back(std::to_string(std::uniform_int_distribution<int>(0, 25)(draw)));
    const std::string dir = temp_dir(), port = std::to_string(free_port());
    dirs.push_back(dir);
    const std::string args = std::string(resume::kTinyModel) +
                             " --global-batch-size 12 --batch-size 3 --steps 10 --collective-timeout 60 --elastic" + plan;
    auto node = [&](int k) {
      return "DTRAIN_TEST_SLOW_STEP_MS=100 DTRAIN_TEST_FAIL_AT_STEP=6 DTRAIN_TEST_FAIL_RANK=3 DTRAIN_TEST_FAIL_KILLS=node "
             "DTRAIN_TEST_FAIL_AFTER_MS=" + moments.back() + " " + bin("dtrun") + " --nnodes 2 --nproc-per-node 2 --node-rank " +
             std::to_string(k) + " --master-addr 127.0.0.1 --master-port " + port +
             " --heartbeat-timeout 3 --rdzv-timeout 30 --keep-survivors " + bin("dtrain-gpt") + args +
             (k == 0 ? " --metrics " + dir + "/m.jsonl" : "") + " > " + dir + "/n" + std::to_string(k) + ".log 2>&1";
    };
    all += "(" + node(1) + " & p1=$!; " + node(0) + "; echo node0_exit=$? > " + dir + "/exit; wait $p1) & ";
  }
  const auto ran = run_command(all + "wait", 150);
  ASSERT_EQ(ran.exit_code, 0) << "the five runs did not end within 150 s\n" << ran.output;
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE(plans[i] + ", " + moments[i] + " ms into step 6");  // (the moment drawn: rerun with it to reproduce)
    const std::string& dir = dirs[i];
    GptRun run = resume::parse_metrics(read_file(dir + "/m.jsonl"));
    run.exit_code = has(read_file(dir + "/exit"), "node0_exit=0") ? 0 : 1;
    run.output = read_file(dir + "/exit") + "\nnode 0:\n" + read_file(dir + "/n0.log") + "\nnode 1:\n" + read_file(dir + "/n1.log");
    expect_uninterrupted(run, full, 2, 1);
    // (lost in step 6, or once step 6 was committed, in the next: the step in flight is redone,
    // with sharded state the snapshots' step after it as well)
    const double redo_from = run.regroups.at(0).at("from_step") + run.regroups[0].at("redone_steps");
    EXPECT_TRUE(redo_from == 6.0 || redo_from == 7.0) << redo_from << "\n" << run.output;
    expect_moved_within_node_0(run);
    EXPECT_TRUE(has(read_file(dir + "/n0.log"), "the dtrun of node 1 stopped responding (no heartbeat for 3 s): its rank(s) 2-3 "
                                                "(and any replacement it started) declared dead"))
        << run.output;
  }
}

TEST(InProcessRecovery, ANodeWhoseLinkGoesDownIsLeftBehind) {
  // Two network namespaces joined by a veth pair (tests/launch/scripts/survivors_netns.sh), a dtrun
  // and two ranks each: after 3 steps node 1's link goes down (no socket closes: its packets stop).
  // Node 0's dtrun declares node 1's ranks dead when its heartbeat stops (3 s), node 0's ranks
  // abort their waits and go on in process at half the size: DDP and HSDP's replica (whole copies),
  // ZeRO-1, ZeRO-2 and FSDP (node 1's shards from the partner snapshots in node 0's memory); node
  // 0's dtrun ends 0, node 1's by itself. The plans run at once, a pair of namespaces each (their
  // steps mostly sleep). Skipped, with the reason, where the machine does not let a test create
  // namespaces.
  const std::string batch = " --global-batch-size 12 --batch-size 3 --steps 12 --collective-timeout 60";
  const GptRun full = resume::gpt(4, batch);
  const std::vector<std::string> plans{" --strategy ddp", " --strategy zero1 --snapshot-every 1", " --strategy zero2 --snapshot-every 1",
                                       " --strategy fsdp --snapshot-every 1", " --strategy hsdp"};
  std::vector<std::string> dirs;
  std::string all;
  for (const std::string& plan : plans) {
    dirs.push_back(temp_dir());
    all += "(" + std::string(DTRAIN_SOURCE_DIR) + "/tests/launch/scripts/survivors_netns.sh " + bin("") + " " + dirs.back() +
           resume::kTinyModel + batch + " --elastic" + plan + " > " + dirs.back() + "/script.log 2>&1; echo $? > " +
           dirs.back() + "/script.rc) & ";
  }
  const auto ran = run_command(all + "wait", 200);
  ASSERT_EQ(ran.exit_code, 0) << "the five runs did not end within 200 s\n" << ran.output;
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE(plans[i]);
    const std::string& dir = dirs[i];
    const std::string out = read_file(dir + "/script.log");
    if (read_file(dir + "/script.rc") == "77\n") GTEST_SKIP() << out;
    GptRun run = resume::parse_metrics(read_file(dir + "/m.jsonl"));
    run.exit_code = has(out, "node0_exit=0") ? 0 : 1;
    run.output = out + "\nnode 0:\n" + read_file(dir + "/n0.log") + "\nnode 1:\n" + read_file(dir + "/n1.log");
    expect_uninterrupted(run, full, 2, 1);
    EXPECT_TRUE(has(out, "node1_exit=1")) << run.output;  // (cut off from the store: it stops)
    EXPECT_TRUE(has(run.output, "the dtrun of node 1 stopped responding (no heartbeat for 3 s): its rank(s) 2-3")) << run.output;
    EXPECT_TRUE(has(read_file(dir + "/n1.log"), "lost the agent store")) << run.output;
    expect_moved_within_node_0(run);
  }
}

TEST(InProcessRecovery, AUsersOwnModelThroughTrainFit) {
  const std::string args = " --hidden 24 --depth 2 --samples 512 --batch-size 2 --global-batch-size 12 --steps 8 --lr 3e-3"
                           " --threads 1 --collective-timeout 60";
  const GptRun full = resume::run_program("dtrain-mlp", 3, args);
  const GptRun run = resume::run_program("dtrain-mlp", 3, args + " --elastic",
                                         "DTRAIN_TEST_FAIL_AT_STEP=4 DTRAIN_TEST_FAIL_RANK=1 DTRAIN_TEST_FAIL_AFTER_MS=2 ",
                                         " --keep-survivors");
  expect_uninterrupted(run, full, 2, 1);
  // Its tensor-parallel variant (the program's own layers on the tensor group it was given,
  // ModelHooks::groups), two pairs: rank 2's pair leaves, the pair 0-1 goes on alone over its
  // re-pointed tensor group (Design note [a group re-pointed], comm/process_group.h).
  const GptRun tp_full = resume::run_program("dtrain-mlp", 4, args + " --tp 2");
  const GptRun tp_run = resume::run_program("dtrain-mlp", 4, args + " --tp 2 --elastic",
                                            "DTRAIN_TEST_FAIL_AT_STEP=4 DTRAIN_TEST_FAIL_RANK=2 DTRAIN_TEST_FAIL_AFTER_MS=2 ",
                                            " --keep-survivors");
  expect_uninterrupted(tp_run, tp_full, 2, 1);
}

TEST(InProcessRecovery, BadCasesEndWithTheirReason) {
  // A global batch with fewer samples than ranks (any other splits, unevenly where it must).
  const GptRun small = elastic_gpt(3, "", " --global-batch-size 2 --batch-size 1 --steps 2 --collective-timeout 60");
  EXPECT_NE(small.exit_code, 0) << small.output;
  EXPECT_TRUE(has(small.output, "the global batch of 2 samples is smaller than the 3 data-parallel ranks")) << small.output;
  // Sharded state without partner snapshots, a strategy not recovered in process (auto picks its
  // plan by the world), no global batch.
  for (const std::string flags : {" --strategy zero2", " --strategy auto", ""}) {
    const std::string batch = flags.empty() ? "" : " --global-batch-size 12";  // ("": the one missing)
    const auto res = run_command(bin("dtrain-gpt") + std::string(resume::kTinyModel) + flags + batch + " --elastic --steps 1", 60);
    EXPECT_NE(res.exit_code, 0) << flags;
    EXPECT_TRUE(has(res.output, "--elastic")) << flags << "\n" << res.output;
  }
  // --memory-budget where the planner does not count the plan (Design note [memory plan]).
  const auto budget = run_command(bin("dtrain-gpt") + std::string(resume::kTinyModel) +
                                      " --strategy ddp --tp 2 --memory-budget 1GiB --global-batch-size 12 --elastic --steps 1", 60);
  EXPECT_NE(budget.exit_code, 0);
  EXPECT_TRUE(has(budget.output, "--memory-budget with --elastic checks the plans the memory planner counts")) << budget.output;
  // (--keep-survivors with --nnodes MIN:MAX: nodes join the running job, Elastic.WithKeepSurvivors...)
}

}  // namespace
}  // namespace dtrain::testing::in_process
