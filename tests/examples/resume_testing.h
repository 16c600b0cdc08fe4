#pragma once
// Helpers of the dtrain-gpt checkpoint tests (resume_test.cpp, fsdp_resume_test.cpp): run the demo
// on W ranks with a tiny model, read its metrics back, check that a resumed run continues a saved one.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "testing/testing.h"

namespace dtrain::testing::resume {

using Fields = std::map<std::string, double>;  // the numeric fields of one metrics line

struct GptRun {
  int exit_code = -1;
  std::string output;
  std::vector<Fields> steps;  // one per step this process trained, in order
  Fields summary;             // the "final" line
  Fields start;               // the "start" line (the plan, the global batch and its split)
  std::vector<Fields> regroups;  // --elastic: one "elastic" line per recovery (train/elastic.h)
};

inline Fields numeric_fields(const std::string& json_line) {
  static const std::regex field("\"([a-z_]+)\": (-?[0-9][0-9.eE+-]*)");
  Fields out;
  for (std::sregex_iterator it(json_line.begin(), json_line.end(), field), end; it != end; ++it) {
    out[(*it)[1]] = std::stod((*it)[2]);
  }
  return out;
}

// A run's metrics file (its text) as start, steps and final records.
inline GptRun parse_metrics(const std::string& metrics) {
  GptRun run;
  std::stringstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"start\": true") != std::string::npos) {
      run.start = numeric_fields(line);
    } else if (line.find("\"elastic\": true") != std::string::npos) {
      run.regroups.push_back(numeric_fields(line));
    } else if (line.find("\"final\": true") != std::string::npos) {
      run.summary = numeric_fields(line);
    } else {
      run.steps.push_back(numeric_fields(line));
    }
  }
  return run;
}

inline constexpr const char* kTinyModel = " --layers 1 --d-model 32 --heads 2 --seq-len 32 --lr 3e-3 --threads 1";

// dtrain-gpt on `world` ranks (one plain process for world 1) with the tiny model and `args` (a
// flag given again in `args` overrides kTinyModel's); `env` prefixes the command (VAR=value ...),
// `dtrun_flags` go to dtrun.
// `program` (a build/bin program on dtrain's library loop) on `world` ranks with `args`.
inline GptRun run_program(const std::string& program, int world, const std::string& args, const std::string& env = "",
                          const std::string& dtrun_flags = "") {
  const std::string launch = world == 1 && dtrun_flags.empty()
                                 ? bin(program)
                                 : bin("dtrun") + " --standalone --nproc-per-node " + std::to_string(world) +
                                       dtrun_flags + " " + bin(program);
  // (Design note [shared runs]: a run without side effects is shared between tests; below)
  bool shareable = env.empty() && (dtrun_flags.empty() || dtrun_flags == " --max-restarts 0");
  for (const char* effect : {"--save", "--resume", "--export-weights", "--tensorboard"}) {
    shareable = shareable && args.find(effect) == std::string::npos;
  }
  auto execute = [&] {
    const std::string metrics = temp_dir() + "/metrics.jsonl";
    // Design note [test launches] (testing/testing.h): ranks start without dtrun unless the run
    // needs dtrun's own behaviour (a test hook in `env`, dtrun flags).
    const bool plain = env.empty() && dtrun_flags.empty();
    auto res = (shareable || plain) && world > 1 ? launch_ranks(bin(program) + args + " --metrics " + metrics, world, 120)
                                      : run_command(env + launch + args + " --metrics " + metrics, 120);
    std::ifstream in(metrics);
    std::stringstream text;
    text << in.rdbuf();
    return SharedRun{res.exit_code, res.output, text.str()};
  };
  // (--max-restarts 0 only makes dtrun launch a single rank too: the run is the same)
  const SharedRun res = shareable ? shared_run(program + " W" + std::to_string(world) + dtrun_flags + args, {program, "dtrun"}, execute)
                                  : execute();
  GptRun run = parse_metrics(res.metrics);
  run.exit_code = res.exit_code;
  run.output = res.output;
  return run;
}

inline GptRun gpt(int world, const std::string& args, const std::string& env = "", const std::string& dtrun_flags = "") {
  return run_program("dtrain-gpt", world, kTinyModel + args, env, dtrun_flags);
}

// Two runs that must train alike: both succeed, every step's loss (and gradient norm where both
// report one) and the final parameter sums within `tol` (relative; sums relative to param_sq), and
// `a` learns.
inline void expect_same(const GptRun& a, const GptRun& b, double tol) {
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  ASSERT_EQ(a.steps.size(), b.steps.size());
  ASSERT_FALSE(a.steps.empty());
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_NEAR(a.steps[i].at("loss"), b.steps[i].at("loss"), tol * std::abs(b.steps[i].at("loss"))) << "step " << i + 1;
    if (a.steps[i].count("grad_norm") && b.steps[i].count("grad_norm")) {
      EXPECT_NEAR(a.steps[i].at("grad_norm"), b.steps[i].at("grad_norm"), tol * b.steps[i].at("grad_norm"))
          << "step " << i + 1;
    }
  }
  const double sq = b.summary.at("param_sq");
  EXPECT_NEAR(a.summary.at("param_sq"), sq, tol * sq);
  EXPECT_NEAR(a.summary.at("param_checksum"), b.summary.at("param_checksum"), tol * sq);
  EXPECT_GT(a.steps.front().at("loss"), a.steps.back().at("loss"));  // it learns
}

// `first` trained steps 1..k and saved, `rest` resumed and trained k+1..n: together they must be
// `full`'s n steps. tol 0: bit for bit; else relative.
inline void expect_continues(const GptRun& first, const GptRun& rest, const GptRun& full, double tol) {
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  ASSERT_EQ(full.exit_code, 0) << full.output;
  std::vector<Fields> joined = first.steps;
  joined.insert(joined.end(), rest.steps.begin(), rest.steps.end());
  ASSERT_EQ(joined.size(), full.steps.size());
  ASSERT_FALSE(rest.steps.empty());
  EXPECT_EQ(rest.summary.at("start_step"), static_cast<double>(first.steps.size()));
  for (size_t i = 0; i < joined.size(); ++i) {
    EXPECT_EQ(joined[i].at("step"), static_cast<double>(i + 1));
    const double a = joined[i].at("loss"), b = full.steps[i].at("loss");
    if (tol == 0) {
      EXPECT_EQ(a, b) << "step " << i + 1;
    } else {
      EXPECT_NEAR(a, b, tol * std::abs(b)) << "step " << i + 1;
    }
  }
  const double sq = full.summary.at("param_sq");
  if (tol == 0) {
    EXPECT_EQ(rest.summary.at("param_checksum"), full.summary.at("param_checksum"));
    EXPECT_EQ(rest.summary.at("param_sq"), sq);
  } else {
    EXPECT_NEAR(rest.summary.at("param_checksum"), full.summary.at("param_checksum"), tol * sq);
    EXPECT_NEAR(rest.summary.at("param_sq"), sq, tol * sq);
  }
}

// A checkpoint saved after 4 steps by `from` on `from_world` ranks, resumed by `to` on `to_world`.
struct Move {
  int from_world;
  std::string from;
  int to_world;
  std::string to;
};

// Each move (`common` before its flags) continues `full`, the uninterrupted run (expect_continues,
// relative `tol`). A checkpoint saved once serves every move from it: resuming reads it, never
// writes it.
inline void expect_moves_continue(const std::string& common, const GptRun& full, const std::vector<Move>& moves,
                                  double tol) {
  std::map<std::string, std::pair<std::string, GptRun>> saved;  // "world flags" -> (checkpoint, its run)
  for (const Move& m : moves) {
    SCOPED_TRACE(std::to_string(m.from_world) + m.from + " -> " + std::to_string(m.to_world) + m.to);
    const std::string from = std::to_string(m.from_world) + m.from;
    if (!saved.count(from)) {
      const std::string ckpt = temp_dir() + "/ck";
      saved.emplace(from, std::make_pair(ckpt, gpt(m.from_world, common + m.from + " --steps 4 --save " + ckpt)));
    }
    const auto& [ckpt, first] = saved.at(from);
    expect_continues(first, gpt(m.to_world, common + m.to + " --resume " + ckpt), full, tol);
  }
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// `crashed` ran 6 steps with DTRAIN_TEST_FAIL_AT_STEP=5 under dtrun --max-restarts 1, saving every 2
// steps under `ckpt`: one rank died at step 5, the restarted group resumed from step 4 and ended
// exactly as `full`, the uninterrupted run.
inline void expect_restarted_from_step_4(const GptRun& crashed, const GptRun& full, const std::string& ckpt) {
  ASSERT_EQ(crashed.exit_code, 0) << crashed.output;
  EXPECT_TRUE(contains(crashed.output, "DTRAIN_TEST_FAIL_AT_STEP=5: killing myself")) << crashed.output;
  EXPECT_TRUE(contains(crashed.output, "restarting workers")) << crashed.output;
  EXPECT_TRUE(contains(crashed.output, "resumed from " + ckpt + "/step-00000004: step 4")) << crashed.output;
  // The restarted attempt rewrote the metrics: steps 5 and 6.
  ASSERT_EQ(crashed.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(crashed.steps[i].at("loss"), full.steps[4 + i].at("loss"));
  EXPECT_EQ(crashed.summary.at("start_step"), 4);
  EXPECT_EQ(crashed.summary.at("param_checksum"), full.summary.at("param_checksum"));
  EXPECT_EQ(crashed.summary.at("param_sq"), full.summary.at("param_sq"));
}

}  // namespace dtrain::testing::resume
