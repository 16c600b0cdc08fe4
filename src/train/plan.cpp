#include "dtrain/train/plan.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

namespace dtrain::train {

using parallel::DataParallel;
using parallel::Plan;

namespace {

std::string str(int64_t n) { return std::to_string(n); }

parallel::Sharding parse_sharding(const std::string& s) {
  if (s == "grad_op") return parallel::Sharding::GradOp;
  if (s == "none") return parallel::Sharding::None;
  if (s == "hybrid") return parallel::Sharding::Hybrid;
  return parallel::Sharding::Full;  // (parse_config allows full, grad_op, none and hybrid only)
}

parallel::Prefetch parse_prefetch(const std::string& s) {
  if (s == "before") return parallel::Prefetch::Before;
  if (s == "after") return parallel::Prefetch::After;
  if (s == "none") return parallel::Prefetch::None;
  return parallel::Prefetch::Default;
}

parallel::Precision parse_precision(const std::string& s) {
  if (s == "bf16") return parallel::Precision::BF16;
  if (s == "fp16") return parallel::Precision::FP16;
  return parallel::Precision::FP32;
}

parallel::FullShardOptions fsdp_options(const TrainConfig& cfg) {
  parallel::FullShardOptions f;
  f.sharding = cfg.sharding.empty() ? (cfg.strategy == "hsdp" ? parallel::Sharding::Hybrid : parallel::Sharding::Full)
                                    : parse_sharding(cfg.sharding);
  f.per_layer = cfg.wrap != "none";
  f.backward_prefetch = parse_prefetch(cfg.backward_prefetch);
  f.overlap_reduction = cfg.overlap_reduction.empty() ? -1 : cfg.overlap_reduction == "on" ? 1 : 0;
  f.max_gathered_units = cfg.max_gathered_units;
  f.cpu_offload = cfg.cpu_offload;
  f.init_on_ranks = cfg.init_on_ranks;
  f.gather_quant = parallel::parse_quant("--gather-quant", cfg.gather_quant);
  f.reduce_quant = parallel::parse_quant("--reduce-quant", cfg.reduce_quant);
  f.secondary_shard = cfg.secondary_shard == "node";
  return f;
}

parallel::PipelineOptions pipeline_options(const TrainConfig& cfg, int pp) {
  parallel::PipelineOptions o;
  if (pp == 1) return o;  // (TrainConfig::validate: no pipeline flag without --pp)
  o.virtual_stages = cfg.virtual_stages;
  o.schedule = cfg.schedule == "gpipe"         ? parallel::Schedule::GPipe
               : cfg.schedule == "interleaved" ? parallel::Schedule::Interleaved
               : cfg.schedule == "1f1b"        ? parallel::Schedule::OneFOneB
               : cfg.virtual_stages > 1        ? parallel::Schedule::Interleaved
                                               : parallel::Schedule::OneFOneB;
  o.microbatches = cfg.microbatches > 0 ? cfg.microbatches : pp;
  return o;
}

// Hybrid sharding's shard group: --shard-size, or this node's data-parallel ranks (local ranks /
// tensor degree: a node holds whole tensor-parallel groups).
int hybrid_shard(const TrainConfig& cfg, int tp, int data_parallel, int local_world_size) {
  int shard = cfg.shard_size;
  if (shard == 0) shard = local_world_size % tp == 0 ? std::max(1, local_world_size / tp) : data_parallel;
  if (shard > data_parallel || data_parallel % shard != 0) {
    throw std::invalid_argument("hybrid sharding: the shard group of " + str(shard) + " rank(s) (" +
                                (cfg.shard_size > 0 ? std::string("--shard-size") : "ranks per node / --tp") +
                                ") must divide the " + str(data_parallel) + " data-parallel rank(s)");
  }
  return shard;
}

// The degrees: pipeline outermost, tensor innermost, the data-parallel ranks between them as the
// kind shares them (parallel/layout.h). Degrees that do not divide the world are left for
// Plan::validate to refuse with its message.
parallel::Layout layout_of(const Plan& p, const TrainConfig& cfg, const Choice& c, int world, int local_world_size) {
  const int mp = c.tensor * c.pipeline;
  const int d = world % mp == 0 ? world / mp : 1;
  parallel::Layout l{d, 1, c.pipeline, c.tensor};
  if (world % mp != 0) return l;
  if (p.shards_optimizer()) l = {1, d, c.pipeline, c.tensor};
  if (p.data == DataParallel::FullShard) {
    switch (p.fsdp.sharding) {
      case parallel::Sharding::Full:
      case parallel::Sharding::GradOp: l = {1, d, c.pipeline, c.tensor}; break;
      case parallel::Sharding::None: break;
      case parallel::Sharding::Hybrid: {
        const int shard = hybrid_shard(cfg, c.tensor, d, local_world_size);
        l = {d / shard, shard, c.pipeline, c.tensor};
        break;
      }
    }
  }
  return l;
}

}  // namespace

DataParallel parse_data_parallel(const std::string& s) {
  if (s == "single") return DataParallel::None;
  if (s == "dp") return DataParallel::Local;
  if (s == "ddp") return DataParallel::Replicate;
  if (s == "zero1") return DataParallel::ShardOptimizer;
  if (s == "zero2") return DataParallel::ShardGradients;
  if (s == "fsdp" || s == "hsdp") return DataParallel::FullShard;
  if (s == "auto") {
    throw std::invalid_argument("--strategy auto is resolved by train::fit's memory planner (train/planner.h): plan "
                                "the run there, or name a strategy");
  }
  throw std::invalid_argument("--strategy must be single, dp, ddp, zero1, zero2, fsdp, hsdp or auto, got '" + s + "'");
}

parallel::Batch split_batch(const TrainConfig& cfg, int world, int data_parallel) {
  parallel::Batch b;
  b.micro = cfg.batch_size;
  b.global = cfg.global_batch_size > 0 ? cfg.global_batch_size : world * cfg.batch_size * cfg.grad_accum;
  if (cfg.elastic) {  // (any world size a job shrinks or grows to: Design note [in-process recovery], train/elastic.h)
    if (b.global < data_parallel) {
      throw std::invalid_argument("--elastic: the global batch of " + str(b.global) + " samples is smaller than the " +
                                  str(data_parallel) + " data-parallel ranks: give a --global-batch-size of at least "
                                  "the largest world size the job may take");
    }
    if (b.global % data_parallel != 0) {  // uneven per-rank batches (Design note [the global batch])
      const int64_t most = (b.global + data_parallel - 1) / data_parallel;
      b.accumulation = (most + cfg.batch_size - 1) / cfg.batch_size;
      b.micro = (most + b.accumulation - 1) / b.accumulation;
      b.uneven = true;
      return b;
    }
    const int64_t share = b.global / data_parallel;  // each rank's samples per step: the largest micro-batch
    b.micro = std::min(cfg.batch_size, share);       // up to --batch-size that divides them, the rest accumulated
    while (share % b.micro != 0) --b.micro;
  }
  const int64_t per_step = data_parallel * b.micro;  // samples of one micro-batch on every data-parallel rank
  if (b.global % per_step != 0) {
    throw std::invalid_argument("the global batch of " + str(b.global) + " samples (" +
                                (cfg.global_batch_size > 0 ? std::string("--global-batch-size")
                                                           : str(world) + " ranks x --batch-size x --grad-accum") +
                                ") does not split into " + str(data_parallel) + " data-parallel rank(s) x --batch-size " +
                                str(b.micro) + ": give a --batch-size that divides " +
                                (b.global % data_parallel == 0 ? str(b.global / data_parallel) : str(b.global) +
                                 " / " + str(data_parallel)));
  }
  b.accumulation = b.global / per_step;
  if (cfg.global_batch_size > 0 && cfg.grad_accum > 1 && cfg.grad_accum != b.accumulation) {
    throw std::invalid_argument("--grad-accum " + str(cfg.grad_accum) + " with --global-batch-size " + str(b.global) +
                                ": the plan accumulates " + str(b.accumulation) + " micro-batch(es) of " + str(b.micro) +
                                " on each of " + str(data_parallel) + " data-parallel rank(s); leave --grad-accum out");
  }
  return b;
}

MicroBatchShare micro_batch_share(const parallel::Batch& b, int data_parallel, int rank, int64_t m) {
  const int64_t mine = (b.global - rank + data_parallel - 1) / data_parallel;  // positions rank, rank + D, ... below G
  MicroBatchShare s;
  s.begin = std::min(mine, m * b.micro);
  s.end = std::min(mine, (m + 1) * b.micro);
  const int64_t n = s.end - s.begin;
  s.divisor = n == 0 ? 0.0 : static_cast<double>(b.global) / static_cast<double>(n * data_parallel);
  return s;
}

std::vector<int64_t> MicroBatchShare::positions(int64_t first, int rank, int data_parallel) const {
  if (begin == end) return {first + rank};
  std::vector<int64_t> out;
  for (int64_t k = begin; k < end; ++k) out.push_back(first + rank + k * data_parallel);
  return out;
}

Plan make_plan(const TrainConfig& cfg, const Choice& choice, int world, int local_world_size) {
  Plan p;
  p.data = choice.data;
  p.recompute = choice.recompute;
  p.sequence_parallel = choice.sequence_parallel;
  p.precision = precision_of(cfg);
  p.loss_scaling = cfg.loss_scaling();
  p.bucket_cap_mb = cfg.bucket_cap_mb;
  p.hierarchical_all_reduce = cfg.hierarchical_all_reduce;
  p.compression = parallel::parse_compression(cfg.grad_compression);
  p.fsdp = fsdp_options(cfg);
  p.pipeline = pipeline_options(cfg, choice.pipeline);
  p.layout = layout_of(p, cfg, choice, world, local_world_size);
  p.batch = split_batch(cfg, world, p.layout.data_parallel());
  p.validate(world);
  return p;
}

Plan make_plan(const TrainConfig& cfg, int world, int local_world_size) {
  return make_plan(cfg, Choice{parse_data_parallel(cfg.strategy), cfg.activation_checkpointing, cfg.tp,
                               cfg.sequence_parallel, cfg.pp}, world, local_world_size);
}

Plan make_plan(const TrainConfig& cfg, const Session& session) {
  return make_plan(cfg, session.pg.size(), session.launch.local_world_size);
}

Plan make_plan(const TrainConfig& cfg, int world) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int per_node = local && std::atoi(local) > 0 ? std::atoi(local) : world;
  return make_plan(cfg, world, per_node);
}

parallel::Groups make_groups(const Plan& plan, const comm::ProcessGroup& pg) {
  return parallel::make_groups(pg, plan.layout);
}

parallel::Groups make_groups(const TrainConfig& cfg, const comm::ProcessGroup& pg) {
  return make_groups(make_plan(cfg, pg.size()), pg);
}

parallel::Precision precision_of(const TrainConfig& cfg) { return parse_precision(cfg.precision); }

at::ScalarType compute_dtype(parallel::Precision precision) {
  switch (precision) {
    case parallel::Precision::BF16: return at::kBFloat16;
    case parallel::Precision::FP16: return at::kHalf;
    case parallel::Precision::FP32: break;
  }
  return at::kFloat;
}

}  // namespace dtrain::train
