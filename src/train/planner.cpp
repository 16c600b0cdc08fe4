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
  f.on_cpu = device.is_cpu();
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

RssPeak::RssPeak(const c10::Device& device) : counted_(device.is_cpu() && util::counting_cpu_allocations()) {}

void RssPeak::start() {
  if (counted_) reset_ = util::trim_heap_and_reset_peak_rss();
}

int64_t RssPeak::besides(int64_t tensor_peak) const {
  if (!counted_) return -1;
  const double peak_rss_mib = util::peak_rss_mib();
  if (reset_ && peak_rss_mib > 0) return std::max<int64_t>(0, static_cast<int64_t>(peak_rss_mib * 1048576.0) - tensor_peak);
  // (the lower bound: what is resident now besides the live tensors and the heap's free blocks)
  return std::max<int64_t>(0, static_cast<int64_t>(util::current_rss_mib() * 1048576.0) - util::cpu_live_bytes() -
                                  util::heap_free_bytes());
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

void add_candidates(MemoryPlan& plan, std::vector<Candidate> more) {
  for (auto& c : more) plan.candidates.push_back(std::move(c));
  // Data parallel first (as plan_memory orders it), then tensor parallel by degree, recomputation,
  // sequence parallelism; then pipeline parallel by degree, recomputation; then both by degree.
  auto key = [](const Candidate& c) {
    const parallel::Layout& l = c.plan.layout;
    const int kind = l.pipeline > 1 && l.tensor > 1 ? 3 : l.pipeline > 1 ? 2 : l.tensor > 1 ? 1 : 0;
    return std::make_tuple(kind, kind == 0 ? 0 : l.tensor * l.pipeline, c.plan.recompute, c.plan.sequence_parallel);
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
  if (!cfg.picks_plan()) return 0;
  // Each rank reads its own device's (or the CPU's available) memory at its own moment: every rank
  // takes the least, so all choose alike. Collective.
  auto t = at::tensor(std::vector<int64_t>{util::default_budget_bytes(session.device, session.launch.local_world_size)},
                      at::kLong).to(session.pg.device());
  comm::all_reduce(session.pg, t, comm::AllReduceOptions().op(comm::ReduceOp::Min));
  return t.to(at::kCPU).item<int64_t>();
}

int64_t check_elastic_budget(const Session& session, const TrainConfig& cfg, const parallel::Plan& plan,
                             const ModelFacts& facts) {
  auto t = at::tensor(std::vector<int64_t>{counted_peak(cfg, plan, facts)}, at::kLong).to(session.pg.device());
  comm::all_reduce(session.pg, t, comm::AllReduceOptions().op(comm::ReduceOp::Max));
  const int64_t need = t.to(at::kCPU).item<int64_t>();
  if (session.pg.rank() == 0) {
    std::printf("%s: --memory-budget: %s at %d rank(s) needs %lld bytes per rank (%s counted; budget %s)\n",
                cfg.program.c_str(), plan.name().c_str(), session.pg.size(), static_cast<long long>(need),
                format_bytes(need).c_str(), format_bytes(cfg.memory_budget).c_str());
    std::fflush(stdout);
  }
  if (need > cfg.memory_budget) {
    throw std::invalid_argument("--elastic: at " + std::to_string(session.pg.size()) + " rank(s) " + plan.name() +
                                " needs " + format_bytes(need) + " (" + std::to_string(need) + " bytes) per rank (the memory "
                                "planner's count), more than --memory-budget " + format_bytes(cfg.memory_budget) + " (" +
                                std::to_string(cfg.memory_budget) + " bytes): the job stops here rather "
                                "than run out of memory (dtrun --max-restarts resumes it from --save's checkpoints; "
                                "or give more ranks, a larger budget or a smaller --batch-size)");
  }
  return need;
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

}  // namespace dtrain::train
