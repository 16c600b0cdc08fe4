#include "dtrain/parallel/plan.h"

#include <sstream>
#include <stdexcept>

namespace dtrain::parallel {

const char* to_string(DataParallel d) {
  switch (d) {
    case DataParallel::None: return "single";
    case DataParallel::Local: return "dp";
    case DataParallel::Replicate: return "ddp";
    case DataParallel::ShardOptimizer: return "zero1";
    case DataParallel::ShardGradients: return "zero2";
    case DataParallel::FullShard: return "fsdp";
  }
  return "?";
}

const char* to_string(Sharding s) {
  switch (s) {
    case Sharding::Full: return "full";
    case Sharding::GradOp: return "grad_op";
    case Sharding::None: return "none";
    case Sharding::Hybrid: return "hybrid";
  }
  return "?";
}

const char* to_string(Prefetch p) {
  switch (p) {
    case Prefetch::Default: return "default";
    case Prefetch::Before: return "before";
    case Prefetch::After: return "after";
    case Prefetch::None: return "none";
  }
  return "?";
}

const char* to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "gpipe";
    case Schedule::OneFOneB: return "1f1b";
    case Schedule::Interleaved: return "interleaved";
  }
  return "?";
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::FP32: return "fp32";
    case Precision::BF16: return "bf16";
    case Precision::FP16: return "fp16";
  }
  return "?";
}

std::string to_string(const CompressionOptions& c) {
  switch (c.kind) {
    case Compression::None: return "none";
    case Compression::BF16: return "bf16";
    case Compression::FP16: return "fp16";
    case Compression::PowerSGD:
      return "powersgd:" + std::to_string(c.rank) +
             (c.warmup_steps != CompressionOptions().warmup_steps ? ":" + std::to_string(c.warmup_steps) : "");
  }
  return "?";
}

const char* to_string(Quant q) {
  switch (q) {
    case Quant::None: return "none";
    case Quant::Int8: return "int8";
    case Quant::Fp8: return "fp8";
  }
  return "?";
}

Quant parse_quant(const std::string& flag, const std::string& text) {
  if (text == "none") return Quant::None;
  if (text == "int8") return Quant::Int8;
  if (text == "fp8") return Quant::Fp8;
  throw std::invalid_argument(flag + " expects none, int8 or fp8 (block-quantized with a scale per 256 values), got '" +
                              text + "'");
}

CompressionOptions parse_compression(const std::string& text) {
  CompressionOptions c;
  if (text == "none") return c;
  if (text == "bf16" || text == "fp16") {
    c.kind = text == "bf16" ? Compression::BF16 : Compression::FP16;
    return c;
  }
  const std::string bad = "--grad-compression expects none, bf16, fp16 or powersgd:R[:WARMUP] (R the rank, e.g. "
                          "powersgd:4; WARMUP the steps averaged uncompressed first, default " +
                          std::to_string(c.warmup_steps) + "), got '" + text + "'";
  if (text.rfind("powersgd:", 0) != 0) throw std::invalid_argument(bad);
  const std::string rest = text.substr(9);
  const size_t colon = rest.find(':');
  auto number = [&](const std::string& s, int low) {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) throw std::invalid_argument(bad);
    const int v = std::stoi(s);
    if (v < low) throw std::invalid_argument(bad);
    return v;
  };
  c.kind = Compression::PowerSGD;
  c.rank = number(rest.substr(0, colon), 1);
  if (colon != std::string::npos) c.warmup_steps = number(rest.substr(colon + 1), 0);
  return c;
}

bool compression_fits(const CompressionOptions& c, DataParallel d) {
  switch (c.kind) {
    case Compression::None: return true;
    case Compression::BF16:
    case Compression::FP16: return d == DataParallel::Replicate || d == DataParallel::ShardOptimizer || d == DataParallel::ShardGradients;
    case Compression::PowerSGD: return d == DataParallel::Replicate || d == DataParallel::ShardOptimizer;
  }
  return false;
}

std::string kind_name(const Plan& p) {
  if (p.data == DataParallel::FullShard && p.fsdp.sharding == Sharding::Hybrid) return "hsdp";
  return to_string(p.data);
}

namespace {

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument(why); }

std::string str(int64_t n) { return std::to_string(n); }

// The degrees against the world size: each divides it and their product is it.
void check_degrees(const Plan& p, int world) {
  const Layout& l = p.layout;
  if (l.replicate < 1 || l.shard < 1 || l.pipeline < 1 || l.tensor < 1) {
    refuse("every parallel degree must be at least 1, got " + l.describe());
  }
  if (world % l.tensor != 0) {
    refuse("--tp " + str(l.tensor) + " must divide the world size (" + str(world) +
           " ranks): the ranks are pipeline x data parallel x tensor parallel");
  }
  if (world % l.pipeline != 0) {
    refuse("--pp " + str(l.pipeline) + " must divide the world size (" + str(world) +
           " ranks): the ranks are pipeline x data parallel x tensor parallel");
  }
  if (world % (l.tensor * l.pipeline) != 0) {
    refuse("--tp " + str(l.tensor) + " x --pp " + str(l.pipeline) + " must divide the world size (" + str(world) +
           " ranks): the ranks are pipeline x data parallel x tensor parallel");
  }
  if (l.size() != world) {
    refuse("parallel layout " + l.describe() + " does not fit " + str(world) + " ranks: pipeline x replicate x shard x "
           "tensor must equal the world size (e.g. shard = ranks per node, replicate = number of nodes)");
  }
}

std::string model_parallel_flags(const Plan& p) {
  std::string s;
  if (p.layout.tensor > 1) s += " --tp " + str(p.layout.tensor);
  if (p.layout.pipeline > 1) s += " --pp " + str(p.layout.pipeline);
  return s;
}

// The data-parallel kind against its degrees and the model parallelism around it.
void check_data_parallel(const Plan& p, int world) {
  const Layout& l = p.layout;
  const int d = l.data_parallel();
  switch (p.data) {
    case DataParallel::None:
      if (d != 1) {
        refuse("--strategy single" + model_parallel_flags(p) + " trains one replica on " + str(l.tensor * l.pipeline) +
               " rank(s), but WORLD_SIZE is " + str(world) + ": use --strategy ddp (or another data-parallel kind) "
               "for the " + str(d) + " replicas" + (l.tensor * l.pipeline == 1 ? ", or run without a launcher" : ""));
      }
      break;
    case DataParallel::Local:
      if (world != 1) {
        refuse("--strategy dp is one process over all local GPUs (DataParallel), but WORLD_SIZE is " + str(world) +
               ": run it without a launcher, or use --strategy ddp");
      }
      break;
    case DataParallel::Replicate:
      if (l.shard != 1) refuse("ddp replicates the model on every data-parallel rank: layout " + l.describe() + " shards it");
      break;
    case DataParallel::ShardOptimizer:
    case DataParallel::ShardGradients:
      if (l.replicate != 1) {
        refuse(std::string(to_string(p.data)) + " splits the optimizer state over every data-parallel rank: layout " +
               l.describe() + " replicates it (hybrid sharding is FSDP's: --strategy hsdp)");
      }
      if (p.data == DataParallel::ShardGradients && l.pipeline > 1) {
        refuse("--pp with --strategy zero2: a pipeline step accumulates every micro-batch's gradients in full, so "
               "sharding them saves nothing over zero1 (DeepSpeed's pipeline allows ZeRO-1 only); use --strategy "
               "zero1, or fsdp to shard the parameters too");
      }
      break;
    case DataParallel::FullShard:
      if (p.fsdp.sharding == Sharding::None && l.shard != 1) refuse("--sharding none replicates: layout " + l.describe());
      if ((p.fsdp.sharding == Sharding::Full || p.fsdp.sharding == Sharding::GradOp) && l.replicate != 1) {
        refuse(std::string("--sharding ") + to_string(p.fsdp.sharding) + " shards over every data-parallel rank: layout " +
               l.describe() + " replicates (use --sharding hybrid)");
      }
      break;
  }
}

// FSDP around pipeline stages: each stage is one unit gathered for the whole step (Design note
// [sharded stages], pipeline/sharded_stages.h), so the per-unit options have nothing to act on.
void check_sharded_stages(const Plan& p) {
  if (p.data != DataParallel::FullShard || p.layout.pipeline == 1) return;
  const FullShardOptions& f = p.fsdp;
  if (f.sharding == Sharding::GradOp || f.sharding == Sharding::None) {
    refuse(std::string("--sharding ") + to_string(f.sharding) + " around pipeline stages: each stage is gathered for "
           "the whole step already (grad_op's behaviour); use --sharding full or hybrid, or --strategy ddp to replicate");
  }
  if (f.init_on_ranks || f.cpu_offload || f.backward_prefetch != Prefetch::Default || f.overlap_reduction >= 0 ||
      f.max_gathered_units > 0 || !f.per_layer || f.secondary_shard) {
    refuse("--strategy fsdp around pipeline stages makes each stage one unit, gathered for the whole step: "
           "--wrap, --init-on-ranks, --cpu-offload, --backward-prefetch, --overlap-reduction, "
           "--max-gathered-units and --secondary-shard have no unit to act on");
  }
}

// --gather-quant / --reduce-quant: FSDP's unit collectives (Design note [block quantization],
// comm/quantized.h); the other kinds gather no parameters and reduce gradient buckets.
void check_quant(const Plan& p) {
  const FullShardOptions& f = p.fsdp;
  if (f.secondary_shard && p.data != DataParallel::FullShard) {
    refuse("--secondary-shard node keeps a copy of FSDP's gathered parameters inside each node; --strategy " + kind_name(p) +
           " gathers none: use --strategy fsdp or hsdp");
  }
  if (f.secondary_shard && (f.sharding == Sharding::GradOp || f.sharding == Sharding::None)) {
    refuse(std::string("--secondary-shard node with --sharding ") + to_string(f.sharding) + ": parameters stay gathered " +
           "from forward to backward, there is no backward gather to keep inside the node (use --sharding full or hybrid)");
  }
  if (f.gather_quant == Quant::None && f.reduce_quant == Quant::None) return;
  const std::string flag = f.gather_quant != Quant::None ? std::string("--gather-quant ") + to_string(f.gather_quant)
                                                         : std::string("--reduce-quant ") + to_string(f.reduce_quant);
  if (p.data != DataParallel::FullShard) {
    refuse(flag + " quantizes the parameter gathers and gradient reduce-scatters of --strategy fsdp or hsdp; --strategy " +
           kind_name(p) + " has none: use --grad-compression bf16, fp16 or powersgd:R for its gradients");
  }
  if (f.reduce_quant == Quant::Fp8) {
    refuse("--reduce-quant fp8: gradients are reduced as int8 blocks only (their sums need int8's uniform steps; fp8 is "
           "for the parameter gathers, --gather-quant fp8)");
  }
  if (f.sharding == Sharding::None && f.gather_quant != Quant::None) {
    refuse(std::string("--gather-quant ") + to_string(f.gather_quant) + " with --sharding none: every rank holds every "
           "parameter, nothing is gathered (--reduce-quant quantizes its gradients' all-reduce)");
  }
}

void check_pipeline(const Plan& p) {
  const PipelineOptions& o = p.pipeline;
  if (p.layout.pipeline == 1) {
    if (o.virtual_stages != 1 || o.schedule == Schedule::Interleaved || o.microbatches != 1) {
      refuse("--microbatches, --schedule and --virtual-stages apply to pipeline parallelism (--pp N)");
    }
    return;
  }
  if (o.schedule == Schedule::Interleaved && o.virtual_stages < 2) {
    refuse("--schedule interleaved needs --virtual-stages 2 or more");
  }
  if (o.schedule != Schedule::Interleaved && o.virtual_stages > 1) {
    refuse("--virtual-stages " + str(o.virtual_stages) + " needs --schedule interleaved");
  }
  if (o.microbatches < 1 || p.batch.micro % o.microbatches != 0) {
    refuse("--microbatches " + str(o.microbatches) + " must divide the micro-batch of " + str(p.batch.micro) +
           " samples (--batch-size): a pipeline cuts each into that many");
  }
  if (o.schedule == Schedule::Interleaved && o.microbatches % p.layout.pipeline != 0) {
    refuse("--schedule interleaved needs the micro-batches (" + str(o.microbatches) +
           ") to be a multiple of the pipeline ranks (" + str(p.layout.pipeline) + ")");
  }
}

// --grad-compression: the strategies whose gradient buckets a hook reduces (Design note
// [gradient compression], ddp/comm_hook.h).
// --hierarchical-all-reduce: DDP's (and ZeRO-1's) bucket all-reduce in two levels (Design note
// [two-level all-reduce], comm/two_level.h).
void check_hierarchical(const Plan& p) {
  if (!p.hierarchical_all_reduce) return;
  if (p.data != DataParallel::Replicate && p.data != DataParallel::ShardOptimizer) {
    refuse("--hierarchical-all-reduce runs the gradient all-reduce of --strategy ddp or zero1 in two levels; --strategy " +
           kind_name(p) + (p.data == DataParallel::FullShard
                               ? " reduce-scatters: its --reduce-quant int8 runs in two levels across nodes"
                               : " has no such all-reduce"));
  }
  if (p.compression.kind == Compression::PowerSGD) {  // (bf16 and fp16 run in two levels: ddp/comm_hook.h)
    refuse("--hierarchical-all-reduce with --grad-compression " + to_string(p.compression) +
           ": PowerSGD owns each bucket's reduction (its factors all-reduced flat); use one or the other, or bf16/fp16");
  }
  if (p.layout.pipeline > 1) {
    refuse("--hierarchical-all-reduce with --pp: the pipeline stages' gradients are averaged once a step, flat");
  }
}

void check_compression(const Plan& p) {
  const Compression k = p.compression.kind;
  if (k == Compression::None) return;
  const std::string flag = "--grad-compression " + to_string(p.compression);
  if (p.data == DataParallel::FullShard) {
    refuse(flag + " compresses the gradient buckets of --strategy ddp, zero1 and zero2; --strategy " + kind_name(p) +
           " reduces flat shards: use --gather-quant int8 / --reduce-quant int8 for fewer bytes, or --strategy zero2 with "
           "this compression");
  }
  if (p.data != DataParallel::Replicate && p.data != DataParallel::ShardOptimizer && p.data != DataParallel::ShardGradients) {
    refuse(flag + " needs data parallelism across processes (--strategy ddp, zero1 or zero2), not --strategy " +
           kind_name(p));
  }
  if (!compression_fits(p.compression, p.data)) {  // (PowerSGD with zero2)
    refuse(flag + " approximates each gradient whole; --strategy zero2 reduce-scatters them to their owners: use "
           "--strategy zero1 or ddp with PowerSGD, or bf16/fp16 with zero2");
  }
  if (p.layout.pipeline > 1) {
    refuse(flag + ": the pipeline stages' gradients are averaged once a step, uncompressed; leave it out with --pp");
  }
}

void check_batch(const Plan& p) {
  const Batch& b = p.batch;
  const int d = p.layout.data_parallel();
  if (b.uneven) {  // (the largest share, ceil(G / D), in `accumulation` micro-batches of at most `micro`)
    const int64_t most = (b.global + d - 1) / d;
    if (b.micro < 1 || b.accumulation < 1 || b.global % d == 0 || b.micro * b.accumulation < most ||
        b.micro * (b.accumulation - 1) >= most) {
      refuse("an uneven split of the global batch of " + str(b.global) + " samples over " + str(d) +
             " data-parallel rank(s) as " + str(b.accumulation) + " micro-batch(es) of up to " + str(b.micro) +
             " does not hold its largest share of " + str(most));
    }
    if (p.layout.pipeline > 1) refuse("uneven per-rank batches (--elastic) are not supported with --pp");
    return;
  }
  if (b.micro < 1 || b.accumulation < 1 || b.global != b.micro * b.accumulation * d) {
    refuse("the global batch of " + str(b.global) + " samples does not split into " + str(d) +
           " data-parallel rank(s) x " + str(b.micro) + " per micro-batch x " + str(b.accumulation) +
           " accumulation step(s)");
  }
}

}  // namespace

void Plan::validate(int world) const {
  check_degrees(*this, world);
  check_data_parallel(*this, world);
  check_sharded_stages(*this);
  check_pipeline(*this);
  check_compression(*this);
  check_hierarchical(*this);
  check_quant(*this);
  check_batch(*this);
  if (sequence_parallel && layout.tensor == 1) refuse("--sequence-parallel applies to tensor parallelism (--tp N)");
}

std::string Plan::name() const {
  std::string s;
  auto add = [&s](const std::string& part) { s += (s.empty() ? "" : "+") + part; };
  if (layout.tensor > 1) add("tp" + str(layout.tensor));
  if (sequence_parallel) add("sp");
  if (layout.pipeline > 1) add("pp" + str(layout.pipeline));
  if (data != DataParallel::None || s.empty()) add(kind_name(*this));
  if (recompute) add("recompute");
  return s;
}

std::string Plan::describe() const {
  std::ostringstream s;
  const int d = data_parallel();
  s << kind_name(*this);
  if (d > 1) s << " over " << d << " ranks";
  if (data == DataParallel::FullShard && layout.replicate > 1) {
    s << " (replicate " << layout.replicate << " x shard " << layout.shard << ")";
  }
  if (layout.tensor > 1) s << " x tensor " << layout.tensor << (sequence_parallel ? " (sequence parallel)" : "");
  if (layout.pipeline > 1) {
    s << " x pipeline " << layout.pipeline << " (" << to_string(pipeline.schedule) << ", " << pipeline.microbatches
      << " micro-batches" << (pipeline.virtual_stages > 1 ? ", " + str(pipeline.virtual_stages) + " virtual stages" : "")
      << ")";
  }
  if (recompute) s << "; recompute";
  if (compression.kind != Compression::None) s << "; gradients sent as " << to_string(compression);
  if (hierarchical_all_reduce) s << "; all-reduce in two levels";
  if (data == DataParallel::FullShard && fsdp.gather_quant != Quant::None) s << "; gathers " << to_string(fsdp.gather_quant);
  if (data == DataParallel::FullShard && fsdp.reduce_quant != Quant::None) s << "; reductions " << to_string(fsdp.reduce_quant);
  if (data == DataParallel::FullShard && fsdp.secondary_shard) s << "; secondary shard per node";
  s << "; " << to_string(precision) << (loss_scaling ? " with loss scaling" : "");
  if (batch.uneven) {  // (--elastic at a world that does not divide it: shares of ceil or floor of G / D)
    s << "; global batch " << batch.global << " over " << d << " ranks unevenly, up to " << batch.micro
      << " per micro-batch x " << batch.accumulation << " accumulation";
  } else {
    s << "; global batch " << batch.global << " = " << d << " x " << batch.micro << " per micro-batch x "
      << batch.accumulation << " accumulation";
  }
  return s.str();
}

std::string Plan::table() const {
  std::ostringstream s;
  auto row = [&s](const char* key, const std::string& value) { s << "  " << key << std::string(22 - std::string(key).size(), ' ') << value << "\n"; };
  row("data_parallel", kind_name(*this));
  row("layout", layout.describe());
  row("sequence_parallel", sequence_parallel ? "yes" : "no");
  row("recompute", recompute ? "yes" : "no");
  row("precision", std::string(to_string(precision)) + (loss_scaling ? ", dynamic loss scaling" : ""));
  row("global_batch", str(batch.global));
  row("micro_batch", str(batch.micro));
  row("accumulation", str(batch.accumulation));
  if (layout.pipeline > 1) {
    row("schedule", to_string(pipeline.schedule));
    row("microbatches", str(pipeline.microbatches));
    row("virtual_stages", str(pipeline.virtual_stages));
  }
  if (data == DataParallel::FullShard) {
    row("sharding", to_string(fsdp.sharding));
    row("units", fsdp.per_layer ? "one per layer" : "one");
    row("gather_quant", to_string(fsdp.gather_quant));
    row("reduce_quant", to_string(fsdp.reduce_quant));
    row("secondary_shard", fsdp.secondary_shard ? "node" : "none");
    if (layout.pipeline == 1) {
      row("backward_prefetch", to_string(fsdp.backward_prefetch));
      row("overlap_reduction", fsdp.overlap_reduction < 0 ? "default" : fsdp.overlap_reduction ? "on" : "off");
      row("max_gathered_units", fsdp.max_gathered_units > 0 ? str(fsdp.max_gathered_units) : "default");
      row("cpu_offload", fsdp.cpu_offload ? "yes" : "no");
      row("init_on_ranks", fsdp.init_on_ranks ? "yes" : "no");
    }
  }
  if (data == DataParallel::Replicate || shards_optimizer()) {
    std::ostringstream mb;
    mb << bucket_cap_mb;
    row("bucket_cap_mb", mb.str());
    row("grad_compression", to_string(compression));
    if (data != DataParallel::ShardGradients) row("two_level_all_reduce", hierarchical_all_reduce ? "yes" : "no");
  }
  return s.str();
}

}  // namespace dtrain::parallel
