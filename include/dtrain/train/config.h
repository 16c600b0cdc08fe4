#pragma once
// The request: what a user asks of a run, as they wrote it (flags, or a configuration document with
// flags over it). train::make_plan (train/plan.h) parses the parallelism it names into a
// parallel::Plan once; the request itself is never changed into the plan.
//
//   dtrain::train::TrainConfig cfg;
//   if (auto rc = dtrain::train::parse_command_line(argc, argv, cfg)) return *rc;
//
// parse_command_line gives any program dtrain-gpt's flags (same names, same errors, --help) plus
// its own, and --config FILE (TOML or JSON: every flag a key, the command line over it),
// --print-config. A flag that does not apply to the request (FSDP flags with DDP, --save-every
// without --save, fp16 on the CPU, ...) is a std::invalid_argument naming it, before anything
// runs; whether the parallelisms combine is the plan's to decide (parallel::Plan::validate).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/optim/lr_schedule.h"

namespace dtrain::train {

struct TrainConfig {
  std::string program = "dtrain";  // names the program in messages ("dtrain-gpt: saved step 4 ...")
  std::string strategy = "ddp";    // single | dp | ddp | zero1 | zero2 | fsdp | hsdp | auto (the memory planner picks)
  int64_t batch_size = 8;          // samples per rank, per micro-batch
  int64_t grad_accum = 1;          // micro-batches per optimizer step
  int64_t global_batch_size = 0;   // samples per step (0: ranks x batch_size x grad_accum; Design note [the global batch])
  int64_t steps = 100;             // optimizer steps (total, also when resuming)
  double lr = 1e-3;                  // the peak learning rate (each step's: lr x the schedule's factor)
  std::string lr_schedule = "constant";  // constant | cosine | linear | wsd (optim/lr_schedule.h)
  int64_t warmup_steps = 0;          // linear warm-up to --lr over the first N steps
  double min_lr = 0;                 // cosine/linear/wsd: the learning rate at the last step
  int64_t decay_steps = 0;           // wsd: the steps of the final decay
  double weight_decay = 0.01;        // adamw (sgd: 0 unless given)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adamw
  uint64_t seed = 0;                 // model init and data order
  std::string optimizer = "adamw";   // adamw | sgd (momentum 0.9)
  int threads = 0;                   // intra-op threads per rank (0: cores / local ranks)
  std::string metrics;               // JSON-lines file written by rank 0 (empty: none)
  std::string tensorboard;           // TensorBoard event files under this directory, rank 0 (empty: none)
  double bucket_cap_mb = 25.0;       // ddp/zero1/zero2 gradient buckets
  bool hierarchical_all_reduce = false;  // ddp/zero1: buckets all-reduced inside the node, then across
  std::string grad_compression = "none";  // ddp/zero1/zero2: none, bf16, fp16, powersgd:R[:WARMUP]
  double clip_grad_norm = 0.0;       // > 0: clip to this global 2-norm
  bool activation_checkpointing = false;  // recompute the model's layers (ModelHooks::recompute)
  std::string precision = "fp32";    // fp32 | bf16 (autocast) | fp16 (autocast, CUDA only)
  std::string device = "cpu";        // cpu | cuda (cuda:LOCAL_RANK)
  std::string backend = "auto";      // auto (gloo for cpu, nccl for cuda) | gloo | nccl
  std::string loss_scale;            // none | dynamic (default: dynamic for fp16, none otherwise)
  int64_t loss_scale_growth_interval = 2000;
  int64_t max_skipped_steps = 10;    // dynamic: stop after this many skipped steps in a row (0: never)
  double collective_timeout_s = 1800;  // a collective waiting longer fails, naming the ranks missing from it
  bool elastic = false;              // survivors of a lost rank go on in process (train/elastic.h; dtrun --keep-survivors)
  int64_t elastic_join_timeout_s = 30;  // --elastic: how long survivors wait for a rank neither joined nor declared dead
  bool cpu_offload = false;          // fsdp/hsdp: shards and optimizer on the CPU
  std::string gather_quant = "none";  // fsdp/hsdp: none, int8, fp8 (parameters all-gathered quantized)
  std::string reduce_quant = "none";  // fsdp/hsdp: none, int8 (gradients reduce-scattered quantized)
  std::string secondary_shard = "none";  // fsdp/hsdp: none, node (the backward's gathers inside the node)
  std::string sharding;              // fsdp/hsdp: full | grad_op | none | hybrid (default full / hybrid)
  std::string wrap = "layer";        // fsdp/hsdp units: layer (ModelHooks::wrap) | none (one unit)
  int shard_size = 0;                // hybrid: ranks per shard group (0: ranks per node / tp)
  bool init_on_ranks = false;        // fsdp/hsdp: build without values, initialise shard by shard
  std::string backward_prefetch;     // fsdp/hsdp: before | after | none (default before)
  std::string overlap_reduction;     // fsdp/hsdp: on | off (default on)
  int max_gathered_units = 0;        // fsdp/hsdp: nested units gathered at once (0: FSDP's default)
  int64_t eval_every = 0;            // the validation loss every N steps and after the last (0: never)
  int64_t eval_batches = 0;          // global batches of held-out samples per evaluation (0: all there are)
  double val_fraction = 0;           // hold out the last fraction of the dataset's samples for evaluation
  std::string val_data;              // the held-out samples from this path (the program loads them)
  bool eval_only = false;            // with --resume: evaluate the checkpoint and stop
  std::string save;                  // checkpoint root (empty: no checkpoints)
  int64_t save_every = 0;            // save every N steps (0: only after the last step)
  bool save_async = false;           // copy the state and write it in the background (checkpoint::AsyncSaver)
  int64_t snapshot_every = 0;        // every N steps each rank's checkpoint state into a partner's memory (0: off)
  bool snapshot_sync = false;        // the snapshot's exchange ends within its step (Design note [sharded state in process])
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
  std::string config;                // the configuration document the request was read from (empty: none)
  std::set<std::string> given;       // the keys the document or the command line changed ("batch-size", ...)
  std::vector<std::pair<std::string, std::string>> program_flags;  // the program's own, as given ("layers", "4")

  // Cross-flag checks of the request (a flag that applies to another strategy or needs another);
  // throws std::invalid_argument naming the flag. parse_config calls it.
  void validate() const;
  void validate_elastic() const;  // (--elastic's part of validate)
  // Whether the memory planner runs: --strategy auto (it picks the plan) or --plan (it prints the
  // table and stops).
  bool planned() const { return picks_plan() || plan; }
  // --strategy auto: the memory planner picks the plan.
  bool picks_plan() const { return strategy == "auto"; }
  // The learning-rate schedule it asks for (--lr-schedule, --warmup-steps, --min-lr, --decay-steps
  // over --steps).
  optim::LrSchedule lr_schedule_of() const;
  // Whether it evaluates on held-out samples (--eval-every or --eval-only).
  bool evaluates() const { return eval_every > 0 || eval_only; }
  // Whether it asks for dynamic loss scaling (--loss-scale dynamic, or fp16 by default).
  bool loss_scaling() const;
};

// A program's own flags, parsed with the common ones.
struct ExtraFlags {
  std::map<std::string, std::function<void(const std::string&)>> valued;  // "--layers" -> setter (throws on bad value)
  std::map<std::string, std::function<void()>> switches;                   // "--verbose" -> setter
  std::string usage;                 // their --help lines
  std::function<void()> check;       // their cross-flag checks, after parsing (throws std::invalid_argument)
};

// The common flags and `extra`, `--flag value` or `--flag=value`, over `--config FILE` when given;
// throws std::invalid_argument naming the flag ("--strategy must be single, dp, ddp, zero1, zero2,
// fsdp, hsdp or auto, got 'x'"; an unknown flag with the nearest known one).
TrainConfig parse_config(const std::vector<std::string>& args, const ExtraFlags& extra = {},
                         TrainConfig defaults = {});

// --help text: `program`'s summary line(s), the common flags, then extra.usage.
std::string usage(const std::string& program, const std::string& summary, const ExtraFlags& extra = {});

// The request as a configuration document (TOML: one `key = value` per line, every common key,
// the program's own given ones after them): what --print-config prints, what every checkpoint and
// the metrics' first record hold.
std::string to_toml(const TrainConfig& cfg);
// The common keys of a document written by to_toml (the program's own left out): e.g. a
// checkpoint's run/config. Throws std::invalid_argument naming `program` for a malformed one.
TrainConfig request_from_toml(const std::string& text, const std::string& program);
// The common keys whose values differ between two requests ("lr: 0.001 -> 0.002"), for --resume.
std::vector<std::string> differences(const TrainConfig& before, const TrainConfig& now);

// For main(): fills `cfg` (cfg.program names the program; its other fields are the defaults).
// Returns nullopt to go on training; otherwise the exit code to return from main: 0 after --help
// (usage on stdout) or --print-config (the document on stdout), 2 after a bad command line (one
// line on stderr: the error, and --help for the rest; printed by rank 0 only under a launcher).
std::optional<int> parse_command_line(int argc, char** argv, TrainConfig& cfg, const ExtraFlags& extra = {},
                                      const std::string& summary = "");

// Flag value helpers for ExtraFlags setters: throw std::invalid_argument naming the flag.
int64_t int_flag(const std::string& flag, const std::string& value, int64_t at_least);
double positive_flag(const std::string& flag, const std::string& value);
double nonnegative_flag(const std::string& flag, const std::string& value);
std::string choice_flag(const std::string& flag, const std::string& value, const std::vector<std::string>& choices);
// "512MiB", "4GiB", "1.5GB", "1000000" -> bytes; throws std::invalid_argument naming the flag.
int64_t parse_memory_size(const std::string& flag, const std::string& text);

}  // namespace dtrain::train
