#pragma once
// The resolved plan of a run: how its ranks train a model, as one validated value (torchtitan's
// ParallelDims with the options that belong to each degree). A request (train::TrainConfig: flags
// or a configuration document) is parsed into a Plan once (train::make_plan); validate() is the one
// place that decides whether a combination is allowed, and every refusal gives its reason of
// method; train::parallelize applies it in one fixed order. Inside the library the kinds are
// enums: their names ("ddp", "fsdp", ...) live in parse and to_string only.
//
//   Plan p;                        // 4 ranks: FSDP over 2 ranks around tensor parallelism of 2
//   p.layout = {1, 2, 1, 2};       // replicate x shard x pipeline x tensor
//   p.data = DataParallel::FullShard;
//   p.batch = {16, 4, 2};          // 16 samples a step = 4 per micro-batch x 2 accumulation x 2 ranks
//   p.validate(4);
//   p.describe();                  // "fsdp 2 x tensor 2; global batch 16 = 2 data-parallel ranks x ..."
#include <cstdint>
#include <string>

#include "dtrain/parallel/layout.h"

namespace dtrain::parallel {

// How the data-parallel ranks of a model part (the model, or a pipeline stage) share it.
enum class DataParallel {
  None,            // single: one replica, no data parallelism
  Local,           // dp: one process over every local GPU (PyTorch's DataParallel)
  Replicate,       // ddp: every rank holds the part whole; gradients all-reduced
  ShardOptimizer,  // zero1: as Replicate, the optimizer state split by parameter over the ranks
  ShardGradients,  // zero2: gradients reduce-scattered to their owners, optimizer state split too
  FullShard,       // fsdp / hsdp: parameters, gradients and optimizer state in flat shards
};
// FullShard: what stays sharded between uses (fsdp::ShardingStrategy).
enum class Sharding { Full, GradOp, None, Hybrid };
// FullShard: when backward gathers the next unit (fsdp::BackwardPrefetch; Default: Before).
enum class Prefetch { Default, Before, After, None };
enum class Schedule { GPipe, OneFOneB, Interleaved };
enum class Precision { FP32, BF16, FP16 };
// How data-parallel gradients travel (Design note [gradient compression], ddp/comm_hook.h).
enum class Compression { None, BF16, FP16, PowerSGD };
// FullShard: what a unit's gathers or reduce-scatters carry (Design note [block quantization],
// comm/quantized.h): the tensors' dtype, or block-quantized int8.
enum class Quant { None, Int8, Fp8 };

struct CompressionOptions {
  Compression kind = Compression::None;
  int rank = 0;          // PowerSGD: the approximation's rank R
  int warmup_steps = 10; // PowerSGD: steps averaged uncompressed first
};

// FullShard's options (layout.pipeline > 1: each stage is one unit gathered for the whole step).
struct FullShardOptions {
  Sharding sharding = Sharding::Full;
  bool per_layer = true;  // units: the program's layers (ModelHooks::wrap), or one unit
  Prefetch backward_prefetch = Prefetch::Default;
  int overlap_reduction = -1;  // -1: FSDP's default (on); 0 off; 1 on
  int max_gathered_units = 0;  // 0: FSDP's default
  bool cpu_offload = false;
  bool init_on_ranks = false;
  Quant gather_quant = Quant::None;  // the parameters' all-gathers
  Quant reduce_quant = Quant::None;  // the gradients' reduce-scatters
  bool secondary_shard = false;      // --secondary-shard node (fsdp/secondary_shard.h)
};

// layout.pipeline > 1: how a pipeline step runs.
struct PipelineOptions {
  Schedule schedule = Schedule::OneFOneB;
  int microbatches = 1;    // pipeline micro-batches each batch.micro samples are cut into
  int virtual_stages = 1;  // stages per pipeline rank (> 1: Interleaved)
};

// The samples of one optimizer step: global = micro x accumulation x the data-parallel ranks
// (the ranks of one tensor-parallel group or pipeline take the same samples).
struct Batch {
  int64_t global = 0;
  int64_t micro = 0;         // samples per rank per forward (a pipeline's are cut further)
  int64_t accumulation = 1;  // micro-batches per optimizer step
  // The data-parallel ranks' shares differ (--elastic at a world size that does not divide the
  // global batch): micro and accumulation are the largest share's, micro-batches are weighted by
  // their samples (train/plan.h, Design note [the global batch]).
  bool uneven = false;
};

struct Plan {
  Layout layout;  // the degrees: replicate x shard x pipeline x tensor
  DataParallel data = DataParallel::Replicate;
  bool sequence_parallel = false;  // tensor > 1: activations between TP regions split along the sequence
  bool recompute = false;          // activation checkpointing of the program's layers
  Precision precision = Precision::FP32;
  bool loss_scaling = false;       // dynamic loss scaling
  Batch batch;
  PipelineOptions pipeline;
  FullShardOptions fsdp;
  double bucket_cap_mb = 25;       // Replicate, ShardOptimizer, ShardGradients: gradient buckets
  CompressionOptions compression;  // Replicate, ShardOptimizer (any), ShardGradients (bf16, fp16)
  bool hierarchical_all_reduce = false;  // Replicate, ShardOptimizer: buckets in two levels (comm/two_level.h)

  // Throws std::invalid_argument naming the reason of method when the plan cannot train on
  // `world` ranks (a degree that does not divide, a combination that cannot work or would save
  // nothing, a batch that does not split); nothing else in the library decides what combines.
  void validate(int world) const;
  // Short name: "ddp", "zero1+recompute", "tp2+sp+fsdp", "pp2+ddp", "tp2+pp2" (the planner's rows).
  std::string name() const;
  // One line: the degrees, the kind, the options that apply, the global batch and its split.
  std::string describe() const;
  // Every resolved value, one per line ("  key  value"), for --plan and --print-config.
  std::string table() const;
  int data_parallel() const { return layout.data_parallel(); }
  bool shards_parameters() const { return data == DataParallel::FullShard; }
  bool shards_optimizer() const {
    return data == DataParallel::ShardOptimizer || data == DataParallel::ShardGradients;
  }
};

// Names, as the command line and the configuration document spell them.
const char* to_string(DataParallel d);  // "single", "dp", "ddp", "zero1", "zero2", "fsdp" (hsdp: see kind_name)
const char* to_string(Sharding s);      // "full", "grad_op", "none", "hybrid"
const char* to_string(Prefetch p);      // "default", "before", "after", "none"
const char* to_string(Schedule s);      // "gpipe", "1f1b", "interleaved"
const char* to_string(Precision p);     // "fp32", "bf16", "fp16"
const char* to_string(Quant q);         // "none", "int8", "fp8"
// Parses a --gather-quant / --reduce-quant value (`flag` names it); std::invalid_argument otherwise.
Quant parse_quant(const std::string& flag, const std::string& text);
std::string to_string(const CompressionOptions& c);  // "none", "bf16", "fp16", "powersgd:4" ("powersgd:4:100": warm-up)
// Whether data-parallel kind `d` can send its gradients as `c` says (Plan::validate's rule; the
// memory planner leaves the others out of --strategy auto).
bool compression_fits(const CompressionOptions& c, DataParallel d);
// Parses the --grad-compression value (as to_string prints it); std::invalid_argument otherwise.
CompressionOptions parse_compression(const std::string& text);
// The kind's name as a user writes it: "hsdp" for FullShard with hybrid sharding.
std::string kind_name(const Plan& p);

}  // namespace dtrain::parallel
