#include "dtrain/train/checkpointing.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <utility>
#include <sstream>
#include <thread>
#include <vector>

#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>

#include "dtrain/checkpoint/manifest.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/checkpoint/train_state.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/barrier.h"
#include "dtrain/comm/broadcast.h"
#include "dtrain/util/parse.h"
#include "dtrain/util/fs.h"

namespace dtrain::train {

namespace ck = dtrain::checkpoint;

namespace {

// Where the data stands after `steps_done` steps: the epoch of the next step and the position of
// its first sample in that epoch's permutation (the same for every world size).
struct Position {
  int64_t epoch = 0;
  int64_t offset = 0;
};
Position position_after(const DataPlan& plan, int64_t steps_done) {
  return {steps_done / plan.steps_per_epoch, (steps_done % plan.steps_per_epoch) * plan.global_batch};
}

// Throws unless the checkpoint's metadata `key` equals this run's `value`; `fix` says what to do.
void expect_same(const ck::Metadata& meta, const std::string& key, int64_t value, const std::string& what,
                 const std::string& fix) {
  const int64_t saved = ck::get_int(meta, key);
  TORCH_CHECK(saved == value, "the checkpoint's ", key, " is ", saved, " but this run's ", what, " is ", value,
              ": the resumed run would see other data than the run it continues; ", fix);
}

// Rank 0: which of the request's values differ from the run that saved the checkpoint (plan and
// configuration; checkpoints from before they were recorded say nothing).
void say_differences(const TrainConfig& o, const ck::Metadata& meta) {
  auto plan = meta.find("run/plan");
  if (plan != meta.end()) std::printf("%s: the checkpoint's plan: %s\n", o.program.c_str(), plan->second.c_str());
  auto config = meta.find("run/config");
  if (config == meta.end()) return;
  TrainConfig saved;
  try {
    saved = request_from_toml(config->second, o.program);
  } catch (const std::exception& e) {  // (only said: rank 0 alone reads it)
    std::printf("%s: the checkpoint's run/config cannot be read (%s)\n", o.program.c_str(), e.what());
    return;
  }
  std::vector<std::string> changed;
  // (Not said: what resuming changes anyway, and where the run writes, which changes no step.)
  static const char* const unsaid[] = {"resume:", "steps:", "metrics:", "tensorboard:", "save:", "save-every:", "export-weights:"};
  for (const auto& d : differences(saved, o)) {
    if (std::none_of(std::begin(unsaid), std::end(unsaid), [&](const char* k) { return d.rfind(k, 0) == 0; })) changed.push_back(d);
  }
  if (changed.empty()) return;
  std::string line;
  for (const auto& d : changed) line += (line.empty() ? "" : "; ") + d;
  std::printf("%s: this run differs from the checkpoint's in: %s\n", o.program.c_str(), line.c_str());
}

// Design note [which checkpoint to resume]
// -----------------------------------------
// --resume ROOT takes the newest checkpoint that is complete and valid on every rank: the one
// `latest` names first, then the committed step-* directories newest first (so a missing `latest`,
// one naming a deleted directory, or a damaged newest checkpoint falls back to an older one). Each
// candidate is opened (manifest parsed and its content_sha256 checked) and all its files hashed by
// the ranks together (file i by rank i % W) before anything is loaded; the ranks agree with one
// all-reduce, so all take the same one. A skipped candidate is named with the reason on the rank
// that found it. A root holding checkpoints none of which is valid is an error, never a silent
// start from step 0 (whose later saves would overwrite them); a root holding none starts from step 0.
// --resume naming one checkpoint directory takes that one or fails.
std::optional<ck::Reader> choose_checkpoint(const TrainConfig& o, const comm::ProcessGroup& pg) {
  const bool one_dir = util::fs::exists(util::fs::join(o.resume, ck::kManifestFileName));
  std::vector<std::string> candidates;
  std::string latest_problem;
  if (one_dir) {
    candidates.push_back(o.resume);
  } else {
    try {
      if (auto d = ck::latest(o.resume)) candidates.push_back(*d);
      else if (util::fs::is_directory(o.resume)) latest_problem = "no `latest` file";
    } catch (const c10::Error& e) {
      latest_problem = e.what_without_backtrace();
    }
    for (auto& d : ck::committed_checkpoints(o.resume)) {
      if (std::find(candidates.begin(), candidates.end(), d) == candidates.end()) candidates.push_back(std::move(d));
    }
  }
  if (candidates.empty()) return std::nullopt;
  if (pg.rank() == 0 && !latest_problem.empty()) {
    std::printf("%s: %s: %s; looking for the newest complete checkpoint there\n", o.program.c_str(), o.resume.c_str(),
                latest_problem.c_str());
  }
  std::vector<std::string> skipped;
  for (const auto& dir : candidates) {
    std::optional<ck::Reader> reader;
    std::string why;
    try {
      reader.emplace(ck::Reader::open(dir));
      reader->verify_files(pg.rank(), pg.size());
    } catch (const std::exception& e) {
      const auto* ce = dynamic_cast<const c10::Error*>(&e);
      why = ce ? ce->what_without_backtrace() : e.what();
      reader.reset();
    }
    auto ok = at::full({1}, reader ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(pg.device()));
    comm::all_reduce(pg, ok, comm::AllReduceOptions().op(comm::ReduceOp::Min));
    if (ok.item<int>() == 1) {
      if (pg.rank() == 0 && (!skipped.empty() || !latest_problem.empty())) {
        std::printf("%s: resuming from %s, the newest checkpoint valid on every rank%s%s\n", o.program.c_str(), dir.c_str(),
                    skipped.empty() ? "" : "; skipped as damaged: ", [&] {
                      std::string s;
                      for (const auto& k : skipped) s += (s.empty() ? "" : ", ") + k;
                      return s;
                    }().c_str());
        std::fflush(stdout);
      }
      return reader;
    }
    if (!why.empty()) {
      std::fprintf(stderr, "%s: rank %d: checkpoint %s cannot be resumed from: %s\n", o.program.c_str(), pg.rank(),
                   dir.c_str(), why.c_str());
      std::fflush(stderr);
    }
    skipped.push_back(dir);
  }
  TORCH_CHECK(false, "--resume ", o.resume, ": ", one_dir ? "the checkpoint" : "none of the " +
              std::to_string(candidates.size()) + " checkpoint(s) there", " is valid on every rank (the reasons are ",
              "printed above, by rank); not starting from step 0 over them: fix or move them, or resume from "
              "another directory");
}

}  // namespace

int64_t resume_checkpoint(const TrainConfig& o, const comm::ProcessGroup& pg, Strategy& strategy, LossScaling& scaling,
                          const DataPlan& plan) {
  if (o.resume.empty()) return 0;
  std::optional<ck::Reader> chosen = choose_checkpoint(o, pg);
  if (!chosen) {
    if (pg.rank() == 0) {
      std::printf("%s: no checkpoint under %s yet: starting from step 0\n", o.program.c_str(), o.resume.c_str());
      std::fflush(stdout);
    }
    return 0;
  }
  const ck::Reader& reader = *chosen;
  const std::string* dir = &reader.dir();
  const ck::Metadata& meta = reader.metadata();
  const int64_t step = ck::get_int(meta, "train/step");
  TORCH_CHECK(step == reader.step(), "the checkpoint ", *dir, " is for step ", reader.step(),
              " but its metadata train/step is ", step, "; the checkpoint is damaged");
  expect_same(meta, "run/seed", static_cast<int64_t>(o.seed), "--seed", "resume with the --seed it was saved with");
  expect_same(meta, "data/samples", plan.samples, "number of samples (--data, --seq-len)",
              "resume with the same --data and --seq-len");
  expect_same(meta, "data/global_batch", plan.global_batch, "global batch (--global-batch-size, or ranks x --batch-size x --grad-accum)",
              "keep the global batch of the saved run (--global-batch-size)");
  const Position at = position_after(plan, step);
  expect_same(meta, "data/epoch", at.epoch, "epoch after step " + std::to_string(step), "check --data");
  expect_same(meta, "data/offset", at.offset, "data offset after step " + std::to_string(step), "check --data");

  if (step >= o.steps && pg.rank() == 0) {
    std::printf("%s: the checkpoint is at step %lld, --steps is %lld: nothing left to train\n", o.program.c_str(),
                static_cast<long long>(step), static_cast<long long>(o.steps));
  }
  // This run's learning rates (from --lr or the program's optimizer) win over the checkpoint's, and a
  // difference is said, never silent.
  std::vector<double> lrs;
  for (auto& g : strategy.optimizer().param_groups()) lrs.push_back(g.options().get_lr());
  const bool hook_state_back = strategy.load_state(reader);
  if (!hook_state_back && pg.rank() == 0 && !reader.keys_with_prefix("compression/").empty()) {
    if (reader.saved_world_size() != pg.size()) {
      std::printf("%s: the checkpoint's gradient-compression state belongs to %d rank(s), this run has %d: it starts "
                  "over, warm-up included\n", o.program.c_str(), reader.saved_world_size(), pg.size());
    } else {
      std::printf("%s: the checkpoint's gradient-compression state lacks some rank's part: it starts over, warm-up "
                  "included\n", o.program.c_str());
    }
  }
  auto& groups = strategy.optimizer().param_groups();
  for (size_t i = 0; i < groups.size() && i < lrs.size(); ++i) {
    const double saved = groups[i].options().get_lr();
    if (saved == lrs[i]) continue;
    if (pg.rank() == 0) {
      std::printf("%s: the checkpoint's learning rate (parameter group %zu) is %g, this run's (--lr) is %g: training "
                  "on with %g\n", o.program.c_str(), i, saved, lrs[i], lrs[i]);
    }
    groups[i].options().set_lr(lrs[i]);
  }
  scaling.load(meta);
  ck::load_rng(reader, pg.rank());
  if (const comm::ProcessGroup* tp = strategy.tensor_group(); tp && tp->size() > 1) {
    // The ranks of a tensor-parallel group draw one stream (Design note [dropout streams]); ranks
    // saved at another layout (e.g. two pipeline stages) held different ones: tensor rank 0's for all.
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    comm::broadcast(*tp, state, comm::BroadcastOptions().src(0));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  if (pg.rank() == 0) {
    std::printf("%s: resumed from %s: step %lld (saved by %d rank(s) with --strategy %s)\n", o.program.c_str(), dir->c_str(),
                static_cast<long long>(step), reader.saved_world_size(), ck::get_string(meta, "run/strategy").c_str());
    say_differences(o, meta);
    std::fflush(stdout);
  }
  return step;
}

bool save_due(const TrainConfig& o, int64_t steps_done) {
  if (o.save.empty()) return false;
  return steps_done == o.steps || (o.save_every > 0 && steps_done % o.save_every == 0);
}

// Everything a checkpoint of step `steps_done` holds: the strategy's state, this rank's random
// streams, the data position and the run's description.
ck::Snapshot state_of(const TrainConfig& o, const comm::ProcessGroup& pg, Strategy& strategy,
                      const LossScaling& scaling, const DataPlan& plan, int64_t steps_done) {
  ck::Snapshot snap = strategy.state_snapshot();
  snap.add(ck::snapshot_rng(pg.rank()));
  const Position at = position_after(plan, steps_done);
  ck::put(snap.metadata, "train/step", steps_done);
  ck::put(snap.metadata, "data/epoch", at.epoch);
  ck::put(snap.metadata, "data/offset", at.offset);
  ck::put(snap.metadata, "data/global_batch", plan.global_batch);
  ck::put(snap.metadata, "data/samples", plan.samples);
  ck::put(snap.metadata, "run/seed", static_cast<int64_t>(o.seed));
  ck::put(snap.metadata, "run/strategy", parallel::kind_name(strategy.plan()));
  ck::put(snap.metadata, "run/plan", strategy.plan().name());
  ck::put(snap.metadata, "run/plan_line", strategy.plan().describe());
  ck::put(snap.metadata, "run/config", to_toml(o));
  ck::put(snap.metadata, "run/world_size", static_cast<int64_t>(pg.size()));
  scaling.save(snap.metadata);
  return snap;
}

std::string save_checkpoint(const TrainConfig& o, const comm::ProcessGroup& pg, Strategy& strategy,
                            const LossScaling& scaling, const DataPlan& plan, int64_t steps_done) {
  const auto t0 = std::chrono::steady_clock::now();
  const ck::Snapshot snap = state_of(o, pg, strategy, scaling, plan, steps_done);
  const std::string dir = ck::save(o.save, steps_done, pg, snap.pieces, snap.metadata);
  // Committed (root/latest names it) before any rank goes on: a rank that dies in the next step
  // cannot take the commit with it.
  comm::barrier(pg);
  if (pg.rank() == 0) {
    std::printf("%s: saved step %lld to %s (%.2f s)\n", o.program.c_str(), static_cast<long long>(steps_done), dir.c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  return dir;
}

ck::AsyncSaveStats save_checkpoint_async(const TrainConfig& o, const comm::ProcessGroup& pg, Strategy& strategy,
                                         const LossScaling& scaling, const DataPlan& plan, int64_t steps_done,
                                         ck::AsyncSaver& saver) {
  const ck::Snapshot snap = state_of(o, pg, strategy, scaling, plan, steps_done);
  const ck::AsyncSaveStats stats = saver.save(o.save, steps_done, snap.pieces, snap.metadata, strategy.steady_tensors());
  if (pg.rank() == 0) {
    std::printf("%s: saving step %lld to %s in the background (the step waited %.3f s%s)\n", o.program.c_str(),
                static_cast<long long>(steps_done), o.save.c_str(), stats.stall_s,
                stats.waited_s > 0 ? ", part of it for the previous save" : "");
    std::fflush(stdout);
  }
  return stats;
}

double take_partner_snapshot(const TrainConfig& o, const comm::ProcessGroup& pg, Strategy& strategy,
                             const LossScaling& scaling, const DataPlan& plan, int64_t steps_done,
                             ck::PartnerSnapshots& snapshots) {
  const auto t0 = std::chrono::steady_clock::now();
  const ck::Snapshot snap = state_of(o, pg, strategy, scaling, plan, steps_done);
  snapshots.take(steps_done, snap.pieces, snap.metadata, strategy.steady_tensors());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void export_weights(const TrainConfig& o, const comm::ProcessGroup& pg, Strategy& strategy) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string path = strategy.export_weights(o.export_weights);
  if (pg.rank() == 0) {
    std::printf("%s: exported the weights to %s (%.2f s)\n", o.program.c_str(), path.c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
}

namespace {
// DTRAIN_TEST_FAIL_KILLS=stall:S: this rank stops making progress for S seconds (stuck in compute:
// alive, its sockets open), then goes on (once: the step is tried again after a regroup). Whether
// it did (instead of being killed).
bool stalled_for_test(const std::string& program, int64_t step, int rank) {
  static bool stalled = false;
  const char* what = std::getenv("DTRAIN_TEST_FAIL_KILLS");
  if (!what || std::string(what).rfind("stall:", 0) != 0) return false;
  if (std::exchange(stalled, true)) return true;
  std::fprintf(stderr, "%s [rank %d]: DTRAIN_TEST_FAIL_AT_STEP=%lld: stalling for %s s (test hook)\n", program.c_str(), rank,
               static_cast<long long>(step), what + 6);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::seconds(std::atoi(what + 6)));
  return true;
}
}  // namespace

void maybe_fail_for_test(const std::string& program, int64_t step, int rank, int world, const char* at) {
  // (a slow step, so that a test can act while a run is in progress: an elastic node joining)
  static const std::optional<int64_t> slow_ms = util::env_int("DTRAIN_TEST_SLOW_STEP_MS");
  if (slow_ms && std::string(at) != "snapshot") std::this_thread::sleep_for(std::chrono::milliseconds(*slow_ms));
  static const std::optional<int64_t> fail_at = util::env_int("DTRAIN_TEST_FAIL_AT_STEP");
  const char* where_env = std::getenv("DTRAIN_TEST_FAIL_WHERE");
  const std::string where = where_env ? where_env : "step";
  const std::optional<int64_t> restart = util::env_int("TORCHELASTIC_RESTART_COUNT");
  if (restart && *restart != 0) return;
  // (the process's first rank and world: after an elastic regroup `rank` and `world` are the new ones)
  // (a process that joined an elastic run: its id, DTRAIN_ELASTIC_JOIN)
  const int64_t first_rank = util::env_int("DTRAIN_ELASTIC_JOIN").value_or(util::env_int("RANK").value_or(rank)), first_world = util::env_int("WORLD_SIZE").value_or(world);
  // DTRAIN_TEST_FAILS="N@R,M@Q": rank R at step N, rank Q at step M (several failures in one run);
  // for a process that joined an elastic run (R its id), N counts its own steps. "N@R:regroup":
  // at that point instead of DTRAIN_TEST_FAIL_WHERE's.
  static const int64_t first_step = step;
  const int64_t own_step = std::getenv("DTRAIN_ELASTIC_JOIN") ? step - first_step + 1 : step;
  bool listed = false;
  if (const char* list = std::getenv("DTRAIN_TEST_FAILS")) {
    std::istringstream in(list);
    for (std::string item; std::getline(in, item, ',');) {
      const auto sign = item.find('@'), colon = item.find(':');
      const std::string point = colon == std::string::npos ? where : item.substr(colon + 1);
      listed = listed || (sign != std::string::npos && point == at && std::stoll(item.substr(0, sign)) == own_step &&
                          std::stoll(item.substr(sign + 1, colon - sign - 1)) == first_rank);
    }
  }
  if (!listed) {
    if (where != at) return;
    if (!fail_at || *fail_at != step) return;
    const int64_t victim = util::env_int("DTRAIN_TEST_FAIL_RANK").value_or(first_world - 1);
    if (victim != first_rank) return;
  }
  if (stalled_for_test(program, step, static_cast<int>(first_rank))) return;
  // DTRAIN_TEST_FAIL_AFTER_MS=M: M ms into the step instead (anywhere in forward, backward, the vote).
  const std::optional<int64_t> after_ms = util::env_int("DTRAIN_TEST_FAIL_AFTER_MS");
  std::fprintf(stderr, "%s [rank %d]: DTRAIN_TEST_FAIL_AT_STEP=%lld: killing myself%s (test hook)\n", program.c_str(),
               static_cast<int>(first_rank), static_cast<long long>(step),
               after_ms ? (" " + std::to_string(*after_ms) + " ms into the step").c_str() : "");
  std::fflush(stderr);
  // DTRAIN_TEST_FAIL_KILLS=node: the whole node goes (its dtrun first; the workers die with it).
  const char* what = std::getenv("DTRAIN_TEST_FAIL_KILLS");
  const pid_t dtrun = what && std::string(what) == "node" ? ::getppid() : 0;
  auto die = [dtrun] {
    if (dtrun > 0) ::kill(dtrun, SIGKILL);
    std::raise(SIGKILL);
  };
  if (after_ms) {
    std::thread([ms = *after_ms, die] {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      die();
    }).detach();
    return;
  }
  die();
}

}  // namespace dtrain::train
