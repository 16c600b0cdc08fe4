#pragma once
// One validated value for how a model trains: the strategy and its options, precision and loss
// scaling, clipping, accumulation, activation checkpointing, checkpoints, metrics, the device. It
// is what train::make_parallel and train::fit take, and train::parse_command_line fills it from
// argc/argv with the flags of dtrain-gpt (same names, same errors, --help), plus the program's
// own flags, so any program gets `--strategy fsdp` etc. in one line:
//
//   dtrain::train::TrainConfig cfg;
//   if (auto rc = dtrain::train::parse_command_line(argc, argv, cfg)) return *rc;
//
// Every bad combination (fp16 on the CPU, FSDP flags with DDP, --save-every without --save, ...)
// is a std::invalid_argument naming the flag, before anything trains.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::train {

struct TrainConfig {
  std::string program = "dtrain";  // names the program in messages ("dtrain-gpt: saved step 4 ...")
  std::string strategy = "ddp";    // single | dp | ddp | zero1 | zero2 | fsdp | hsdp | auto (the memory planner picks)
  int64_t batch_size = 8;          // samples per rank, per micro-batch
  int64_t grad_accum = 1;          // micro-batches per optimizer step
  int64_t steps = 100;             // optimizer steps (total, also when resuming)
  double lr = 1e-3;
  uint64_t seed = 0;                 // model init and data order
  std::string optimizer = "adamw";   // adamw (weight decay 0.01) | sgd (momentum 0.9)
  int threads = 0;                   // intra-op threads per rank (0: cores / local ranks)
  std::string metrics;               // JSON-lines file written by rank 0 (empty: none)
  std::string tensorboard;           // TensorBoard event files under this directory, rank 0 (empty: none)
  double bucket_cap_mb = 25.0;       // ddp/zero1/zero2 gradient buckets
  double clip_grad_norm = 0.0;       // > 0: clip to this global 2-norm
  bool activation_checkpointing = false;  // recompute the model's layers (ModelHooks::recompute)
  std::string precision = "fp32";    // fp32 | bf16 (autocast) | fp16 (autocast, CUDA only)
  std::string device = "cpu";        // cpu | cuda (cuda:LOCAL_RANK)
  std::string backend = "auto";      // auto (gloo for cpu, nccl for cuda) | gloo | nccl
  std::string loss_scale;            // none | dynamic (default: dynamic for fp16, none otherwise)
  int64_t loss_scale_growth_interval = 2000;
  int64_t max_skipped_steps = 10;
  double collective_timeout_s = 1800;  // a collective waiting longer fails, naming the ranks missing from it    // dynamic: stop after this many skipped steps in a row (0: never)
  bool cpu_offload = false;          // fsdp/hsdp: shards and optimizer on the CPU
  std::string sharding;              // fsdp/hsdp: full | grad_op | none | hybrid (default full / hybrid)
  std::string wrap = "layer";        // fsdp/hsdp units: layer (ModelHooks::wrap) | none (one unit)
  int shard_size = 0;                // hybrid: ranks per shard group (0: LOCAL_WORLD_SIZE)
  bool init_on_ranks = false;        // fsdp/hsdp: build without values, initialise shard by shard
  std::string backward_prefetch;     // fsdp/hsdp: before | after | none (default before)
  std::string overlap_reduction;     // fsdp/hsdp: on | off (default on)
  int max_gathered_units = 0;        // fsdp/hsdp: nested units gathered at once (0: FSDP's default)
  std::string save;                  // checkpoint root (empty: no checkpoints)
  int64_t save_every = 0;            // save every N steps (0: only after the last step)
  std::string resume;                // checkpoint root (or directory) to resume from, if it has one
  std::string export_weights;        // after the last step: one plain safetensors file
  double peak_tflops = 0;            // the device's peak for mfu (0: known GPUs by name)
  int pp = 1;                        // pipeline ranks (stages x virtual stages cut the model; > 1: pipeline)
  int microbatches = 0;              // --pp: micro-batches per batch-size batch (0: pp)
  std::string schedule;              // --pp: gpipe | 1f1b | interleaved (default 1f1b; interleaved when v > 1)
  int virtual_stages = 1;            // --pp: stages per pipeline rank (> 1: interleaved)
  int tp = 1;                        // tensor-parallel ranks (> 1: the program builds its model from TP layers)
  bool sequence_parallel = false;    // --tp: activations between TP regions split along the sequence
  int64_t memory_budget = 0;         // --strategy auto: bytes per rank (0: the device's memory; train/planner.h)
  bool plan = false;                 // print the memory plan (train/planner.h) and stop before training

  bool fsdp() const { return strategy == "fsdp" || strategy == "hsdp"; }
  // Clears the fsdp/hsdp-only settings (a configuration moved to another strategy by the planner).
  void drop_sharding_flags();
  // Cross-flag checks and defaults (sharding, loss_scale); throws std::invalid_argument naming the
  // flag. parse_config calls it.
  void validate();
};

// A program's own flags, parsed with the common ones.
struct ExtraFlags {
  std::map<std::string, std::function<void(const std::string&)>> valued;  // "--layers" -> setter (throws on bad value)
  std::map<std::string, std::function<void()>> switches;                   // "--verbose" -> setter
  std::string usage;                 // their --help lines
  std::function<void()> check;       // their cross-flag checks, after parsing (throws std::invalid_argument)
};

// The common flags and `extra`, `--flag value` or `--flag=value`; throws std::invalid_argument
// naming the flag ("--strategy must be single, dp, ddp, zero1, zero2, fsdp, hsdp or auto, got 'x'").
TrainConfig parse_config(const std::vector<std::string>& args, const ExtraFlags& extra = {},
                         TrainConfig defaults = {});

// --help text: `program`'s summary line(s), the common flags, then extra.usage.
std::string usage(const std::string& program, const std::string& summary, const ExtraFlags& extra = {});

// For main(): fills `cfg` (cfg.program names the program; its other fields are the defaults).
// Returns nullopt to go on training; otherwise the exit code to return from main: 0 after --help
// (usage on stdout), 2 after a bad command line (the error and the usage on stderr).
std::optional<int> parse_command_line(int argc, char** argv, TrainConfig& cfg, const ExtraFlags& extra = {},
                                      const std::string& summary = "");

// Flag value helpers for ExtraFlags setters: throw std::invalid_argument naming the flag.
int64_t int_flag(const std::string& flag, const std::string& value, int64_t at_least);
double positive_flag(const std::string& flag, const std::string& value);
std::string choice_flag(const std::string& flag, const std::string& value, const std::vector<std::string>& choices);

}  // namespace dtrain::train
