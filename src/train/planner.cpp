#include "dtrain/train/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/ddp/bucket.h"
#include "dtrain/fsdp/unit_plan.h"
#include "dtrain/nn/hooked.h"
#include "dtrain/optim/partition.h"
#include "dtrain/util/parse.h"

namespace dtrain::train {
namespace {
int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}
}  // namespace

int64_t parse_memory_size(const std::string& flag, const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const auto number = util::parse_double(text.substr(0, i));
  const std::string unit = text.substr(i);
  static const std::vector<std::pair<std::string, double>> units = {
      {"", 1},           {"B", 1},           {"KiB", 1024.0},   {"MiB", 1048576.0}, {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6},        {"GB", 1e9},        {"TB", 1e12}};
  for (const auto& [name, scale] : units) {
    if (unit == name && number && *number > 0) return static_cast<int64_t>(std::llround(*number * scale));
  }
  throw std::invalid_argument(flag + " expects a size such as 512MiB, 4GiB or 1.5GB (KiB/MiB/GiB/TiB, KB/MB/GB/TB or "
                              "bytes), got '" + text + "'");
}

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1073741824.0) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / 1073741824.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / 1048576.0);
  }
  return buf;
}

namespace detail {
namespace {

// Tensors of the given sizes that hold one element each (for the partition and bucket functions,
// which read sizes only).
std::vector<at::Tensor> stand_ins(const std::vector<int64_t>& numels) {
  std::vector<at::Tensor> out;
  const at::Tensor one = at::zeros({1});
  for (int64_t n : numels) out.push_back(one.expand({n}));
  return out;
}

}  // namespace

ModelFacts describe_model(torch::nn::Module& model, const ModelHooks& hooks, const TrainConfig& cfg,
                          const c10::Device& device) {
  ModelFacts f;
  f.bucket_cap_bytes = static_cast<int64_t>(cfg.bucket_cap_mb * 1024 * 1024);
  // Units as FSDP makes them (the same plan: fsdp/unit_plan.h).
  const bool per_layer = cfg.wrap != "none" && hooks.wrap.fn;
  const fsdp::UnitPlan units_plan = fsdp::plan_units(model, per_layer ? hooks.wrap : fsdp::WrapPolicy::none());
  const auto& owner = units_plan.owner;
  const int units = static_cast<int>(units_plan.unit_nodes.size());
  f.unit_numels.assign(units, 0);
  std::unordered_set<const void*> seen;
  for (const auto& p : model.parameters()) {  // model order, each distinct tensor once
    const void* key = p.unsafeGetTensorImpl();
    if (!seen.insert(key).second) continue;
    f.element_bytes = static_cast<int64_t>(p.element_size());
    if (!p.requires_grad()) {
      f.frozen_bytes += p.numel() * static_cast<int64_t>(p.element_size());
      continue;
    }
    f.param_numels.push_back(p.numel());
    const auto it = owner.find(key);
    f.unit_numels[it == owner.end() ? 0 : it->second] += p.numel();
  }
  for (const auto& b : model.buffers()) f.buffer_bytes += b.numel() * static_cast<int64_t>(b.element_size());
  const int64_t model_bytes = f.element_bytes * sum(f.param_numels) + f.frozen_bytes + f.buffer_bytes;
  f.other_bytes = std::max<int64_t>(0, util::live_bytes(device) - model_bytes);
  return f;
}

void agree(ModelFacts& f, const comm::ProcessGroup& pg) {
  auto t = at::tensor(std::vector<int64_t>{f.activation_bytes, f.recompute_activation_bytes, f.other_bytes,
                                           f.rss_besides_bytes}, at::kLong)
               .to(pg.device());
  comm::all_reduce(pg, t, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  t = t.to(at::kCPU);
  f.activation_bytes = t[0].item<int64_t>();
  f.recompute_activation_bytes = t[1].item<int64_t>();
  f.other_bytes = t[2].item<int64_t>();
  f.rss_besides_bytes = t[3].item<int64_t>();
}

void agree_on_largest(Candidate& c, const comm::ProcessGroup& pg) {
  const std::vector<int64_t> mine{c.total(), c.params, c.grads, c.optimizer, c.buffers, c.step_extra, c.other, c.rss_besides};
  const int64_t k = static_cast<int64_t>(mine.size());
  auto all = at::empty({k * pg.size()}, at::kLong).to(pg.device());
  comm::all_gather(pg, all, at::tensor(mine, at::kLong).to(pg.device()));
  all = all.to(at::kCPU).view({pg.size(), k});
  const int64_t r = all.select(1, 0).argmax().item<int64_t>();
  auto row = all[r];
  c.params = row[1].item<int64_t>();
  c.grads = row[2].item<int64_t>();
  c.optimizer = row[3].item<int64_t>();
  c.buffers = row[4].item<int64_t>();
  c.step_extra = row[5].item<int64_t>();
  c.other = row[6].item<int64_t>();
  c.rss_besides = all.select(1, 7).max().item<int64_t>();
}

namespace {
at::Generator default_generator(const c10::Device& d) {
  return d.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(d);
}
}  // namespace

RandomStateGuard::RandomStateGuard(const c10::Device& device) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  if (!device.is_cpu()) devices.push_back(device);
  for (const auto& d : devices) {
    at::Generator gen = default_generator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_.emplace_back(d, gen.get_state());
  }
}

RandomStateGuard::~RandomStateGuard() {
  for (const auto& [d, state] : rng_) {
    at::Generator gen = default_generator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
}

MeasureGuard::MeasureGuard(torch::nn::Module& model, const c10::Device& device) : rng_(device) {
  at::NoGradGuard no_grad;
  for (const auto& b : model.buffers()) {
    buffers_.push_back(b);
    saved_.push_back(b.clone());
  }
}

MeasureGuard::~MeasureGuard() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_[i]);
}

bool recomputes(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* h = dynamic_cast<nn::Hookable*>(m.get()); h && h->forward_hooks().has(nn::HookOrder::Recompute)) return true;
  }
  return false;
}

int64_t rss_besides_tensors() {
  if (!util::counting_cpu_allocations()) return -1;
  return std::max<int64_t>(0, static_cast<int64_t>(util::current_rss_mib() * 1048576.0) - util::cpu_live_bytes() -
                                  util::heap_free_bytes());
}

void RssPeak::start() {
  if (cpu_ && util::counting_cpu_allocations()) reset_ = util::trim_heap_and_reset_peak_rss();
}

int64_t RssPeak::besides(int64_t tensor_peak) const {
  if (!cpu_ || !util::counting_cpu_allocations()) return -1;
  const double peak_rss_mib = util::peak_rss_mib();
  if (!reset_ || peak_rss_mib <= 0) return rss_besides_tensors();
  return std::max<int64_t>(0, static_cast<int64_t>(peak_rss_mib * 1048576.0) - tensor_peak);
}

void zero_grads(torch::nn::Module& model) {
  for (auto& p : model.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

void drop_grads(torch::nn::Module& model) {
  for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
}

}  // namespace detail

MemoryPlan plan_memory(const TrainConfig& cfg, int world, const ModelFacts& f, int64_t budget) {
  TORCH_CHECK(cfg.tp == 1 && cfg.pp == 1, "the memory planner plans data-parallel strategies: give --strategy with --tp/--pp");
  MemoryPlan plan;
  plan.budget = budget;
  plan.world = world;
  const int64_t E = f.element_bytes;
  const int64_t N = sum(f.param_numels);
  const int64_t largest = f.param_numels.empty() ? 0 : *std::max_element(f.param_numels.begin(), f.param_numels.end());
  const int states = cfg.optimizer == "sgd" ? 1 : 2;  // AdamW: exp_avg, exp_avg_sq; SGD: momentum
  // The optimizer's temporaries in step, for a tensor of n elements (AdamW: sqrt(v) and its quotient).
  auto step_temp = [&](int64_t n) { return cfg.optimizer == "sgd" ? int64_t{0} : 2 * E * n; };
  const int64_t other = f.buffer_bytes + f.frozen_bytes + f.other_bytes;
  auto activations = [&](bool recompute) {
    return recompute && f.recompute_activation_bytes >= 0 ? f.recompute_activation_bytes : f.activation_bytes;
  };
  const bool can_recompute = f.recompute_activation_bytes >= 0;
  auto add = [&](Candidate c) {
    c.rss_besides = f.rss_besides_bytes;
    plan.candidates.push_back(std::move(c));
  };

  // Replicated: parameters, their gradients (DDP: views into its buckets), the optimizer state.
  auto replicated = [&](const std::string& name, const std::string& strategy, bool recompute) {
    Candidate c{name, strategy, recompute};
    c.params = E * N;
    c.grads = E * N;
    c.optimizer = states * E * N;
    c.step_extra = std::max(activations(recompute), step_temp(largest));
    c.other = other;
    return c;
  };
  if (world == 1) {
    if (!cfg.activation_checkpointing) add(replicated("single", "single", false));
    if (can_recompute) add(replicated("single+recompute", "single", true));
  } else {
    // (--activation-checkpointing given: every candidate recomputes, and says so in its name)
    const std::string rc = cfg.activation_checkpointing ? "+recompute" : "";
    add(replicated("ddp" + rc, "ddp", cfg.activation_checkpointing));
    // ZeRO: the optimizer state of the parameters a rank owns (partition_greedy; the rank with most).
    const auto part = optim::partition_greedy(detail::stand_ins(f.param_numels), world);
    int busiest = 0;
    for (int r = 1; r < world; ++r) busiest = part.elements[r] > part.elements[busiest] ? r : busiest;
    int64_t owned_largest = 0;
    for (size_t i : part.by_rank[busiest]) owned_largest = std::max(owned_largest, f.param_numels[i]);
    Candidate z1{"zero1" + rc, "zero1", cfg.activation_checkpointing};
    z1.params = E * N;
    z1.grads = E * N;
    z1.optimizer = states * E * part.elements[busiest];
    // In step, after the owned parameters' update: each owner's parameters broadcast as one flat
    // copy (broadcast_coalesced), the largest owner's on every rank.
    int64_t owned_most = 0;
    for (int r = 0; r < world; ++r) owned_most = std::max(owned_most, part.elements[r]);
    z1.step_extra = std::max({activations(z1.recompute), step_temp(owned_largest), E * owned_most});
    z1.other = other;
    add(z1);
    // ZeRO-2: gradients kept for the owned elements only.
    const auto buckets = ddp::assign_buckets(detail::stand_ins(f.param_numels), f.bucket_cap_bytes, 1 << 20);
    int64_t largest_bucket = 0;
    for (const auto& b : buckets) {
      int64_t n = 0;
      for (size_t i : b) n += f.param_numels[i];
      largest_bucket = std::max(largest_bucket, n);
    }
    Candidate z2{"zero2" + rc, "zero2", cfg.activation_checkpointing};
    z2.params = E * N;
    z2.grads = E * part.elements[busiest];
    z2.optimizer = z1.optimizer;
    // A scratch of the owned part (an owned gradient carried over while its bucket reduces); at the
    // end of backward, when the activations are freed, the flat bucket and what its reduce-scatter
    // receives (Gloo: every rank's part of it, as big as the bucket, comm/reduce_scatter.cpp; NCCL:
    // a padded copy when the parts are uneven).
    z2.buffers = E * part.elements[busiest];
    z2.step_extra = std::max(z1.step_extra, 2 * E * largest_bucket);
    // --grad-accum: under no_sync the micro-batches' gradients accumulate whole in .grad (as
    // PyTorch's ShardedDDP); the last backward frees them into the bucket as it reaches them, so
    // they add to that backward's activations, not to the bucket's end.
    if (cfg.grad_accum > 1) z2.step_extra = std::max(z2.step_extra, activations(z2.recompute) + E * N);
    z2.other = other;
    add(z2);
    // FSDP: each unit's padded shard (parameters, gradient, optimizer state); the root gathered
    // with its gradient through backward; in a nested unit's backward (Design note [backward
    // memory], default prefetch) two units' parameters and two units' gradients, one more block the
    // BlockPool keeps for the next gather (keep_per_size 1), and a reduce-scatter's receive buffer
    // and sum (a unit and a part of it, comm/reduce_scatter.cpp), plus the previous one's, which
    // Gloo's worker thread may hold a moment after it completed: a race, measured in about half of the
    // runs (the counted peak of one configuration varies by that much), counted at half. The
    // optimizer steps one flat shard at a time.
    int64_t shard = 0, shard_largest = 0, root = f.unit_numels.empty() ? N : f.unit_numels[0], nested = 0;
    for (size_t u = 0; u < f.unit_numels.size(); ++u) {
      const int64_t s = (f.unit_numels[u] + world - 1) / world;
      shard += s;
      shard_largest = std::max(shard_largest, s);
      if (u > 0) nested = std::max(nested, f.unit_numels[u]);
    }
    if (f.unit_numels.size() == 1) nested = root;  // (--wrap none: the root is the one unit)
    for (bool recompute : {false, true}) {
      if (recompute && !can_recompute) continue;
      if (!recompute && cfg.activation_checkpointing) continue;
      Candidate c{recompute ? "fsdp+recompute" : "fsdp", "fsdp", recompute};
      c.params = E * shard;
      c.grads = E * shard;
      c.optimizer = states * E * shard;
      const int64_t receive = nested + (nested + world - 1) / world;  // a reduce-scatter's buffers
      // (the previous reduce-scatter's buffers are still held in about half the runs: counted at half)
      c.buffers = E * (2 * root + (f.unit_numels.size() == 1 ? 0 : 5 * nested) + receive + receive / 2);
      // --grad-accum: under no_sync the full gradients accumulate in .grad (as PyTorch's FSDP) and
      // stay to the step; in backward they are the units' gradient buffers (two fewer units).
      if (cfg.grad_accum > 1) {
        c.grads += E * N;
        c.buffers = std::max<int64_t>(0, c.buffers - 2 * E * nested);
      }
      c.step_extra = std::max(activations(recompute), step_temp(shard_largest));
      c.other = other;
      add(c);
    }
  }
  choose(plan);
  return plan;
}

std::vector<Candidate> tensor_parallel_candidates(const TrainConfig& cfg, int world, int tp, bool sequence_parallel,
                                                  const ModelFacts& facts) {
  TORCH_CHECK(tp > 1 && world % tp == 0, "tensor parallel degree ", tp, " must divide the world size ", world);
  TrainConfig dp_cfg = cfg;
  dp_cfg.tp = 1;
  dp_cfg.pp = 1;
  dp_cfg.sequence_parallel = false;
  const MemoryPlan around = plan_memory(dp_cfg, world / tp, facts, 0);
  std::vector<Candidate> out;
  for (Candidate c : around.candidates) {
    // (around TP: single, ddp, fsdp; ZeRO-1/2 over pieces is not built, config.cpp)
    if (c.strategy != "single" && c.strategy != "ddp" && c.strategy != "fsdp") continue;
    c.tp = tp;
    c.sequence_parallel = sequence_parallel;
    c.name = "tp" + std::to_string(tp) + (sequence_parallel ? "+sp" : "") + (c.strategy == "single" ? "" : "+" + c.strategy) +
             (c.recompute ? "+recompute" : "");
    out.push_back(std::move(c));
  }
  return out;
}

void add_candidates(MemoryPlan& plan, std::vector<Candidate> more) {
  for (auto& c : more) plan.candidates.push_back(std::move(c));
  // Data parallel first (as plan_memory orders it), then by TP degree, recomputation, sequence
  // parallelism; then pipeline parallelism by degree, recomputation. The order within each as given.
  auto key = [](const Candidate& c) {
    const int kind = c.pp > 1 ? 2 : c.tp > 1 ? 1 : 0;
    return std::make_tuple(kind, kind == 0 ? 0 : c.tp * c.pp, c.recompute, c.sequence_parallel);
  };
  std::stable_sort(plan.candidates.begin(), plan.candidates.end(),
                   [&](const Candidate& a, const Candidate& b) { return key(a) < key(b); });
  choose(plan);
}

void choose(MemoryPlan& plan) {
  plan.chosen = -1;
  if (plan.budget <= 0) return;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    if (plan.candidates[i].total() <= plan.budget) {
      plan.chosen = static_cast<int>(i);
      return;
    }
  }
}

int64_t budget_for(const Session& session, const TrainConfig& cfg) {
  if (cfg.memory_budget > 0) return cfg.memory_budget;
  if (cfg.strategy != "auto") return 0;
  // Each rank reads its own device's (or the CPU's available) memory at its own moment: every rank
  // takes the least, so all choose alike. Collective.
  auto t = at::tensor(std::vector<int64_t>{util::default_budget_bytes(session.device, session.launch.local_world_size)},
                      at::kLong).to(session.pg.device());
  comm::all_reduce(session.pg, t, comm::AllReduceOptions().op(comm::ReduceOp::Min));
  return t.to(at::kCPU).item<int64_t>();
}

std::string format_plan(const MemoryPlan& plan, const std::string& program) {
  std::string s;
  char line[256];
  std::snprintf(line, sizeof line, "%s: memory plan per rank, %d rank%s%s%s (Design note [memory plan]):\n", program.c_str(),
                plan.world, plan.world == 1 ? "" : "s", plan.budget > 0 ? ", budget " : "",
                plan.budget > 0 ? format_bytes(plan.budget).c_str() : "");
  s += line;
  bool rss = false;
  for (const auto& c : plan.candidates) rss = rss || c.rss_besides >= 0;
  std::snprintf(line, sizeof line, "  %-22s %10s %10s %10s %10s %10s %10s %11s%s\n", "strategy", "params", "grads", "optimizer",
                "buffers", "step", "other", "peak", rss ? "     RSS" : "");
  s += line;
  auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    const Candidate& c = plan.candidates[i];
    char rss_text[32] = "";
    if (c.rss_besides >= 0) std::snprintf(rss_text, sizeof rss_text, " %7.0f", mib(c.rss_besides + c.total()));
    std::snprintf(line, sizeof line, "%s %-22s %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %7.1f MiB%s%s\n",
                  static_cast<int>(i) == plan.chosen ? "*" : " ", c.name.c_str(), mib(c.params), mib(c.grads),
                  mib(c.optimizer), mib(c.buffers), mib(c.step_extra), mib(c.other), mib(c.total()), rss_text,
                  plan.budget > 0 && c.total() > plan.budget ? "  (over budget)" : "");
    s += line;
  }
  for (const auto& why : plan.not_built) s += "  (not built: " + why + ")\n";
  s += "  (MiB; step: the most a step adds to the state: one micro-batch's forward + backward (measured), the "
       "reduction's buckets or the optimizer's temporaries; ppN: above the state in two trial steps; preference: top first";
  s += rss ? "; RSS: the peak plus what the process held besides tensors at the measurement's peak)\n" : ")\n";
  return s;
}

const Candidate& chosen(const MemoryPlan& plan) {
  if (plan.chosen >= 0) return plan.candidates[plan.chosen];
  TORCH_CHECK(!plan.candidates.empty(), "the memory plan has no candidates");
  const Candidate* least = &plan.candidates[0];
  for (const auto& c : plan.candidates) least = c.total() < least->total() ? &c : least;
  throw std::invalid_argument("--memory-budget " + format_bytes(plan.budget) + " per rank is too small: the smallest "
                              "need is " + least->name + " at " + format_bytes(least->total()) + " per rank on " +
                              std::to_string(plan.world) + " rank(s); give a budget of at least that, more ranks, "
                              "or a smaller --batch-size");
}

TrainConfig with_choice(const TrainConfig& cfg, const MemoryPlan& plan) {
  if (cfg.strategy != "auto") return cfg;
  const Candidate& c = chosen(plan);
  TrainConfig out = cfg;
  out.strategy = c.strategy;
  out.activation_checkpointing = c.recompute;
  out.tp = c.tp;
  out.pp = c.pp;
  out.sequence_parallel = c.sequence_parallel;
  out.memory_budget = 0;
  out.validate();
  return out;
}

}  // namespace dtrain::train
