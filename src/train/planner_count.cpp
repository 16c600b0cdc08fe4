// The memory planner's counting (Design note [memory plan], train/planner.h): each data-parallel
// kind's per-rank bytes from the model's facts, over the plan's data-parallel ranks, at the plan's
// accumulation.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "dtrain/compat.h"
#include "dtrain/ddp/bucket.h"
#include "dtrain/optim/partition.h"
#include "dtrain/train/planner.h"

namespace dtrain::train {
namespace {

using parallel::DataParallel;

int64_t total_of(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

// Tensors of the given sizes that hold one element each (for the partition and bucket functions,
// which read sizes only).
std::vector<at::Tensor> stand_ins(const std::vector<int64_t>& numels) {
  std::vector<at::Tensor> out;
  const at::Tensor one = at::zeros({1});
  for (int64_t n : numels) out.push_back(one.expand({n}));
  return out;
}

// What every count needs: the facts and the request's optimizer.
struct Counting {
  const ModelFacts& f;
  bool sgd;
  int64_t E, N, largest, other;
  Counting(const ModelFacts& facts, const TrainConfig& cfg)
      : f(facts), sgd(cfg.optimizer == "sgd"), E(facts.element_bytes), N(total_of(facts.param_numels)),
        largest(facts.param_numels.empty() ? 0 : *std::max_element(facts.param_numels.begin(), facts.param_numels.end())),
        other(facts.buffer_bytes + facts.frozen_bytes + facts.other_bytes) {}
  int states() const { return sgd ? 1 : 2; }  // AdamW: exp_avg, exp_avg_sq; SGD: momentum
  // The optimizer's temporaries in step, for a tensor of n elements (AdamW: sqrt(v) and its quotient).
  int64_t step_temp(int64_t n) const { return sgd ? int64_t{0} : 2 * E * n; }
  int64_t activations(bool recompute) const {
    return recompute && f.recompute_activation_bytes >= 0 ? f.recompute_activation_bytes : f.activation_bytes;
  }
};

Candidate start(const parallel::Plan& p, const Counting& k) {
  Candidate c{p, p.name()};
  c.rss_besides = k.f.rss_besides_bytes;
  c.other = k.other;
  return c;
}

// The members of a data-parallel group of `group` ranks on each node where it spans several nodes
// with as many on each (comm::split_by_node's two levels), else 0: LOCAL_WORLD_SIZE over the
// tensor-parallel degree (tensor ranks are the innermost).
int members_per_node(const parallel::Plan& p, int group) {
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int l = local ? std::atoi(local) / std::max(1, p.layout.tensor) : group;
  return l > 1 && l < group && group % l == 0 ? l : 0;
}

// --hierarchical-all-reduce on Gloo (the CPU): a workspace of each bucket's size, kept (Design note
// [two-level all-reduce], comm/two_level.h), where the group spans nodes.
int64_t two_level_workspaces(const parallel::Plan& p, const Counting& k, int group) {
  const bool hooked = p.compression.kind != parallel::Compression::None;  // (the cast hook's temporaries instead)
  return p.hierarchical_all_reduce && !hooked && k.f.on_cpu && members_per_node(p, group) > 0 ? k.E * k.N : 0;
}

// --grad-compression bf16 / fp16 under ddp and zero1: the cast hook's buffers, kept per bucket from
// its first step (ddp::NarrowBuffers, Design note [gradient compression], ddp/comm_hook.h), for
// the N gradient elements in 16 bits: the narrow copy where the backend sums 16-bit values
// (NCCL; Gloo's fp16 on 1.13); else the parts too, the gathered copy and on Gloo the two
// collectives' workspaces; in two levels, the within level's so, the fp32 part and the across
// level's own over N / L. (ZeRO-2's are transient: Design note [buffers reused].)
int64_t hook_buffers(const parallel::Plan& p, const Counting& k, int group) {
  using parallel::Compression;
  if (p.compression.kind != Compression::BF16 && p.compression.kind != Compression::FP16) return 0;
  const bool gloo = k.f.on_cpu;
  const bool native = !gloo || (p.compression.kind == Compression::FP16 && compat::kGlooHandlesHalf);
  auto split = [gloo](int64_t n, int w) { return 2 * n + 2 * (n / w) + 2 * n + (gloo ? 4 * n : 0); };
  auto flat = [&](int64_t n, int w) { return native ? 2 * n : split(n, w); };
  const int l = p.hierarchical_all_reduce ? members_per_node(p, group) : 0;
  if (l > 0) return split(k.N, l) + 4 * (k.N / l) + flat(k.N / l, group / l);
  return flat(k.N, group);
}

// Replicated: parameters, their gradients (DDP: views into its buckets), the optimizer state.
Candidate replicated(const parallel::Plan& p, const Counting& k) {
  Candidate c = start(p, k);
  c.params = c.grads = k.E * k.N;
  c.buffers = two_level_workspaces(p, k, p.data_parallel()) + hook_buffers(p, k, p.data_parallel());
  c.optimizer = k.states() * k.E * k.N;
  c.step_extra = std::max(k.activations(p.recompute), k.step_temp(k.largest));
  return c;
}

// ZeRO: the optimizer state of the parameters a rank owns (partition_greedy; the rank with most).
// zero1 then broadcasts each owner's parameters as one flat copy in step (broadcast_coalesced), the
// largest owner's on every rank; zero2 keeps the owned gradients only.
Candidate zero(const parallel::Plan& p, const Counting& k) {
  const int d = p.data_parallel();
  const auto part = optim::partition_greedy(stand_ins(k.f.param_numels), d);
  int busiest = 0;
  for (int r = 1; r < d; ++r) busiest = part.elements[r] > part.elements[busiest] ? r : busiest;
  int64_t owned_largest = 0, owned_most = 0;
  for (size_t i : part.by_rank[busiest]) owned_largest = std::max(owned_largest, k.f.param_numels[i]);
  for (int r = 0; r < d; ++r) owned_most = std::max(owned_most, part.elements[r]);
  Candidate c = start(p, k);
  c.params = c.grads = k.E * k.N;
  c.optimizer = k.states() * k.E * part.elements[busiest];
  c.step_extra = std::max({k.activations(p.recompute), k.step_temp(owned_largest), k.E * owned_most});
  c.buffers = two_level_workspaces(p, k, d) + hook_buffers(p, k, d);
  if (p.data == DataParallel::ShardOptimizer) return c;
  const auto buckets = ddp::assign_buckets(stand_ins(k.f.param_numels), k.f.bucket_cap_bytes, 1 << 20);
  int64_t largest_bucket = 0;
  for (const auto& b : buckets) {
    int64_t n = 0;
    for (size_t i : b) n += k.f.param_numels[i];
    largest_bucket = std::max(largest_bucket, n);
  }
  c.grads = k.E * part.elements[busiest];
  // At the end of backward, when the activations are freed, the flat bucket and what its
  // reduce-scatter receives (Gloo: every rank's part of it, as big as the bucket, summed straight
  // into the owned part, comm/reduce_scatter.cpp; NCCL: a padded copy when the parts are uneven).
  // (The loop zeroes the gradients before each step, so no owned gradient is carried into a
  // scratch part: ddp/sharded_data_parallel.cpp.)
  c.buffers = 0;
  c.step_extra = std::max(c.step_extra, 2 * k.E * largest_bucket);
  // Accumulation: under no_sync the micro-batches' gradients accumulate whole in .grad (as
  // PyTorch's ShardedDDP); the last backward frees them into the bucket as it reaches them, so
  // they add to that backward's activations, not to the bucket's end.
  if (p.batch.accumulation > 1) c.step_extra = std::max(c.step_extra, k.activations(p.recompute) + k.E * k.N);
  return c;
}

// FSDP: each unit's padded shard (parameters, gradient, optimizer state); the root gathered with
// its gradient through backward. The rest is FSDP's pool (Design note [buffers reused],
// util/block_pool.h). On the CPU it keeps, through the whole step, the most blocks of each size in use
// at once, which in a nested unit's backward (Design note [backward memory], default prefetch,
// overlapped reductions) are two units' parameters and the prefetch's all-gather workspace, two
// units' gradients and two reduce-scatters' workspaces and outputs (a unit and a part of it each,
// comm/reduce_scatter.cpp); of the root's size, its parameters, gradient and reduce-scatter
// workspace and output (fp32: the cast shards of mixed precision are not counted). On a GPU (one
// free block per size; NCCL needs no workspace) the count from before the pool: two units'
// parameters and gradients, one block the pool keeps, and one and a half units plus parts for the
// reduce-scatters, a calibration that held within 10% on an H200 (docs/memory_planner.md). The
// optimizer steps one flat shard at a time.
// --secondary-shard node (Design note [secondary shards], fsdp/secondary_shard.h): from its forward
// to its backward every nested unit keeps 1 / L of its padded parameters (L: members_per_node).
// Elements.
int64_t node_copies(const parallel::Plan& p, const std::vector<int64_t>& units, int d) {
  const int shard = p.fsdp.sharding == parallel::Sharding::Hybrid ? p.layout.shard : d;
  const int l = members_per_node(p, shard);
  if (!p.fsdp.secondary_shard || l == 0) return 0;
  int64_t n = 0;
  for (size_t u = 1; u < units.size(); ++u) n += (units[u] + shard - 1) / shard * shard / l;
  return n;
}

Candidate fsdp(const parallel::Plan& p, const Counting& k) {
  const int d = p.data_parallel();
  const auto& units = k.f.unit_numels;
  int64_t shard = 0, shard_largest = 0, root = units.empty() ? k.N : units[0], nested = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    const int64_t s = (units[u] + d - 1) / d;
    shard += s;
    shard_largest = std::max(shard_largest, s);
    if (u > 0) nested = std::max(nested, units[u]);
  }
  if (units.size() == 1) nested = root;  // (--wrap none: the root is the one unit)
  Candidate c = start(p, k);
  c.params = c.grads = k.E * shard;
  c.optimizer = k.states() * k.E * shard;
  const auto part = [d](int64_t n) { return (n + d - 1) / d; };
  if (k.f.on_cpu) {
    const int64_t root_pool = 3 * root + part(root);
    c.buffers = k.E * (units.size() == 1 ? root_pool : root_pool + 7 * nested + 2 * part(nested));
  } else {
    const int64_t receive = nested + part(nested);  // a reduce-scatter's buffers
    c.buffers = k.E * (2 * root + (units.size() == 1 ? 0 : 5 * nested) + receive + receive / 2);
  }
  // Accumulation: under no_sync the full gradients accumulate in .grad (as PyTorch's FSDP) and stay
  // to the step; in backward they are the units' gradient buffers (two fewer units).
  if (p.batch.accumulation > 1) {
    c.grads += k.E * k.N;
    c.buffers = std::max<int64_t>(0, c.buffers - 2 * k.E * nested);
  }
  c.step_extra = std::max(k.activations(p.recompute), k.step_temp(shard_largest));
  // Node copies (in the master dtype's size: bf16's are half): on the CPU from the pool, which keeps
  // its blocks through the step; on a GPU they come and go with the activations.
  const int64_t copies = k.E * node_copies(p, units, d);
  if (k.f.on_cpu) {
    c.buffers += copies;
  } else {
    c.step_extra = std::max(k.activations(p.recompute) + copies, k.step_temp(shard_largest));
  }
  return c;
}

Candidate count(const parallel::Plan& p, const Counting& k) {
  switch (p.data) {
    case DataParallel::ShardOptimizer:
    case DataParallel::ShardGradients: return zero(p, k);
    case DataParallel::FullShard: return fsdp(p, k);
    default: return replicated(p, k);
  }
}

// The data-parallel kinds around tensor parallelism of degree `tp` on `world` ranks, fastest first:
// one rank: single (and single with recomputation); several: ddp, zero1, zero2, fsdp, fsdp with
// recomputation. With --activation-checkpointing every one recomputes.
std::vector<Candidate> candidates_at(const TrainConfig& cfg, int world, int tp, bool sp, const ModelFacts& f) {
  const Counting k(f, cfg);
  const bool can_recompute = f.recompute_activation_bytes >= 0, rc = cfg.activation_checkpointing;
  std::vector<Choice> choices;
  if (world == tp) {
    if (!rc) choices.push_back({DataParallel::None, false, tp, sp});
    if (can_recompute) choices.push_back({DataParallel::None, true, tp, sp});
  } else {
    for (DataParallel d : {DataParallel::Replicate, DataParallel::ShardOptimizer, DataParallel::ShardGradients}) {
      choices.push_back({d, rc, tp, sp});
    }
    if (!rc) choices.push_back({DataParallel::FullShard, false, tp, sp});
    if (can_recompute) choices.push_back({DataParallel::FullShard, true, tp, sp});
  }
  const parallel::CompressionOptions compression = parallel::parse_compression(cfg.grad_compression);
  const bool quant = cfg.gather_quant != "none" || cfg.reduce_quant != "none" ||  // (fsdp's collectives only)
                     cfg.secondary_shard != "none";
  std::vector<Candidate> out;
  for (const Choice& c : choices) {
    const bool all_reduces = c.data == DataParallel::Replicate || c.data == DataParallel::ShardOptimizer;
    if (parallel::compression_fits(compression, c.data) && (!quant || c.data == DataParallel::FullShard) &&
        (!cfg.hierarchical_all_reduce || all_reduces)) {
      out.push_back(count(make_plan(cfg, c, world, world), k));
    }
  }
  if (out.empty() && cfg.hierarchical_all_reduce) {
    throw std::invalid_argument("--hierarchical-all-reduce acts on the gradient all-reduce of ddp and zero1: --strategy "
                                "auto has no such plan on " + std::to_string(world) + " rank(s)" +
                                (quant ? " with FSDP's flags" : ""));
  }
  if (out.empty() && quant) {
    throw std::invalid_argument("--gather-quant / --reduce-quant / --secondary-shard act on FSDP's collectives: --strategy auto has no "
                                "fsdp plan on " + std::to_string(world) + " rank(s)");
  }
  if (out.empty()) {
    throw std::invalid_argument("--grad-compression " + cfg.grad_compression + " needs data parallelism across "
                                "processes (ddp, zero1 or zero2): --strategy auto has no such plan on " +
                                std::to_string(world) + " rank(s)");
  }
  return out;
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& cfg, int world, const ModelFacts& f, int64_t budget) {
  TORCH_CHECK(cfg.tp == 1 && cfg.pp == 1, "the memory planner plans data-parallel strategies: give --strategy with --tp/--pp");
  MemoryPlan plan;
  plan.budget = budget;
  plan.world = world;
  plan.candidates = candidates_at(cfg, world, 1, false, f);
  choose(plan);
  return plan;
}

bool counted(const parallel::Plan& plan) {
  const bool hybrid = plan.data == DataParallel::FullShard && plan.fsdp.sharding == parallel::Sharding::Hybrid;
  return plan.layout.tensor == 1 && plan.layout.pipeline == 1 && !hybrid;
}

int64_t counted_peak(const TrainConfig& cfg, const parallel::Plan& plan, const ModelFacts& facts) {
  return counted(plan) ? count(plan, Counting(facts, cfg)).total() : -1;
}

std::vector<Candidate> tensor_parallel_candidates(const TrainConfig& cfg, int world, int tp, bool sequence_parallel,
                                                  const ModelFacts& facts) {
  TORCH_CHECK(tp > 1 && world % tp == 0, "tensor parallel degree ", tp, " must divide the world size ", world);
  return candidates_at(cfg, world, tp, sequence_parallel, facts);
}

}  // namespace dtrain::train
