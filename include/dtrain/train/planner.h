#pragma once
// The memory planner: `--strategy auto --memory-budget SIZE` picks the fastest plan whose
// predicted per-rank peak fits the budget, and `--plan` prints the table it chose from without
// training. train::fit runs it on the user's model before parallelize; every candidate is a
// parallel::Plan at the request's global batch (Design note [the global batch], train/plan.h).
//
// Design note [memory plan]
// A rank's peak in a training step is model state plus what one step adds to it. Model state is
// counted, not measured: parameters, gradients and optimizer state (states per element by the
// optimizer: AdamW 2, SGD with momentum 1; in the parameters' dtype) come from the model's
// parameter sizes and, per strategy, how it splits them: ZeRO's owners by partition_greedy (the
// rank with the most), FSDP's padded flat shards per unit (unit sizes from hooks.wrap, as FSDP
// builds them). What a step adds depends on the data and the model's code, so it is measured: one
// micro-batch's forward and backward on this rank (with the gradients already allocated, as in every
// step after the first), its peak above the state before it, with and without hooks.recompute's
// modules recomputed. Each strategy's own buffers are counted from its design notes: DDP's gradient
// buckets (the gradients are views into them), ZeRO-2's flat bucket in flight, FSDP's gathered
// units and their gradients in backward (Design note [backward memory], fsdp/iteration.cpp), and
// the optimizer's temporaries in step (AdamW: two of the largest tensor it steps). The step's peak
// is the larger of backward's and the optimizer's. Preference order, fastest first: ddp (single on
// one rank), zero1, zero2, fsdp, fsdp with recomputation; the first that fits is chosen. Checked:
// tests/train/planner_test.cpp runs every candidate and compares the prediction with the counted
// peak (util/memory.h) within 10%.
//
// Tensor parallelism is planned when the program builds its model per layout (train::fit with a
// build function, fit.h): each TP degree that divides the world size, with and without sequence
// parallelism, is built on its own groups and measured like the plain model (the rank's pieces are
// its parameters; the TP collectives' buffers are in the measured step); around it every
// data-parallel kind (single; or ddp, zero1, zero2, fsdp, fsdp with recomputation) is counted on
// world / TP ranks from those facts, at the plan's accumulation. They come after the data-parallel ones, by degree,
// then recomputation, then sequence parallelism. A layout the program cannot build (heads or
// vocabulary not divisible) is listed as such.
//
// Pipeline parallelism is planned the same way but measured, not counted: what a stage holds
// depends on the schedule's micro-batches in flight and on what the program's stage function keeps,
// so the layout is built (parallelize) and two trial steps run on the rank's first micro-batch
// (measure_pipeline); the prediction is their peak, the rank with the most. Around the stages
// single or ddp, with and without recomputation, after TP in the preference; TP x PP layouts the
// same way, last (plan_layouts.h). Not planned: CPU offload, mixed precision's 16-bit copies.
//
// RSS (CPU): the budget is about tensors, but the table also predicts each candidate's peak RSS:
// its counted peak plus what the process held besides counted tensors at the peak of a measured
// phase (detail::RssPeak): libtorch's, Gloo's and the BLAS's code and buffers and what the heap
// held free then. Before the phase the heap's free pages go back to the system (malloc_trim) and
// the peak RSS is reset (/proc/self/clear_refs "5"), so the phase's peak RSS minus its counted peak
// is that figure; every rank takes the largest. train::fit resets the peak RSS again after the plan,
// so a planned run's peak_rss_mib is the training's. Measured within 10% for every candidate on
// the allocator dtrun preloads by default; on glibc's, FSDP with units of a few MiB measures up to
// 18% more, its freed blocks fragmenting the heap (docs/memory_planner.md).
//
// Membership changes (--elastic with --memory-budget SIZE and a named strategy): a job that loses
// ranks re-splits sharded state over fewer of them (ZeRO's optimizer parts, FSDP's shards grow by
// W / W'), so a plan that fit may no longer. Each rank measures the model's facts once as it enters
// the job (elastic_facts: the first generation together, a joining rank alone) and every generation's
// plan, the first too, is counted from them at its world size and batch split before its model is
// put under it; the ranks take the largest count, and where it exceeds the budget every rank stops
// with the reason (check_elastic_budget) instead of running out of memory in the next step. (The
// measurement runs the unsharded model's forward and backward once, with its whole gradients, as
// --strategy auto's does: a model that only fits sharded cannot be measured so.) Counted
// plans only (ddp, zero1, zero2, fsdp): with --tp, --pp or hsdp --memory-budget is refused (their
// peaks are measured, not counted; under ddp and hsdp whole units leave a rank's memory as it was).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "dtrain/amp/autocast.h"
#include "dtrain/data/distributed_sampler.h"
#include "dtrain/recompute/checkpoint.h"
#include "dtrain/train/config.h"
#include "dtrain/train/session.h"
#include "dtrain/train/parallelize.h"
#include "dtrain/train/plan.h"
#include "dtrain/util/memory.h"
#include "dtrain/util/system.h"

namespace dtrain::train {

// What the planner knows of the model (collected on one rank; every rank takes the largest).
struct ModelFacts {
  std::vector<int64_t> param_numels;  // trainable parameters, each distinct tensor once, model order
  int64_t element_bytes = 4;          // bytes per parameter element (the model's floating dtype)
  bool on_cpu = true;                 // the model's device (FSDP's pool: Design note [buffers reused])
  int64_t frozen_bytes = 0;           // parameters that do not require grad
  int64_t buffer_bytes = 0;
  // FSDP units by hooks.wrap: trainable elements of each unit, [0] the root's own (wrap none: one).
  std::vector<int64_t> unit_numels;
  int64_t activation_bytes = 0;            // one micro-batch's forward + backward, above the state
  int64_t recompute_activation_bytes = -1;  // the same with hooks.recompute's modules (-1: not measured)
  int64_t other_bytes = 0;                  // live tensors on the device that are not the model's
  // CPU: the process's resident memory at its peak that is not counted tensors (libtorch's and
  // Gloo's code and buffers, the BLAS's, what the heap held free then): a measured pass's peak RSS
  // minus its counted peak, the larger with and without recomputation (detail::RssPeak; -1: not
  // on the CPU).
  int64_t rss_besides_bytes = -1;
  int64_t bucket_cap_bytes = 25 << 20;      // (cfg.bucket_cap_mb)
};

// One plan, and its predicted per-rank peak by what holds the bytes (the rank with the most).
struct Candidate {
  parallel::Plan plan;  // what it trains
  std::string name;     // plan.name(): "ddp", "zero1", "fsdp+recompute", "tp2", "tp2+sp+fsdp", "tp2+pp2+ddp", ...
  // CPU: what the process held at its peak besides tensors in the measurement the candidate is
  // predicted from (the plain model's, the TP model's, or a PP layout's trial steps; -1: not on the
  // CPU); the predicted peak RSS is this plus total().
  int64_t rss_besides = -1;
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t buffers = 0;      // the kind's own: DDP buckets, ZeRO-2's bucket, FSDP's gathered units
  int64_t step_extra = 0;   // above the state: max(forward + backward, optimizer step)
  int64_t other = 0;        // the model's buffers and the program's other tensors (data, ...)
  int64_t total() const { return params + grads + optimizer + buffers + step_extra + other; }
};

struct MemoryPlan {
  std::vector<Candidate> candidates;  // in the order of preference (fastest first)
  int64_t budget = 0;                 // bytes per rank (0: none given)
  int chosen = -1;                    // the first that fits (-1: none, or no budget)
  int world = 1;
  std::vector<std::string> not_built;  // layouts the program could not build, with the reason
};

// The data-parallel candidates for cfg on `world` ranks (cfg.tp and cfg.pp must be 1), every one
// at cfg's global batch, and the first that fits `budget` (bytes per rank; 0: none chosen).
MemoryPlan plan_memory(const TrainConfig& cfg, int world, const ModelFacts& facts, int64_t budget);
// Whether the planner counts `plan` from the model's facts (ddp, zero1, zero2, fsdp, single; no
// --tp, --pp or hybrid shards: those are measured), and its counted per-rank peak at the plan's own
// world size and batch split (-1 where not counted).
bool counted(const parallel::Plan& plan);
int64_t counted_peak(const TrainConfig& cfg, const parallel::Plan& plan, const ModelFacts& facts);
// The candidates with tensor parallelism of degree `tp` (sequence parallel or not) on `world` ranks,
// from the facts of the model built for that degree (a rank's pieces): every data-parallel kind
// around TP on world / tp ranks, named "tp<N>[+sp][+<kind>][+recompute]".
std::vector<Candidate> tensor_parallel_candidates(const TrainConfig& cfg, int world, int tp, bool sequence_parallel,
                                                  const ModelFacts& facts);
// Adds `more` after the plan's candidates (by TP degree, recomputation, sequence parallelism) and
// chooses again.
void add_candidates(MemoryPlan& plan, std::vector<Candidate> more);
// Sets plan.chosen: the first candidate within plan.budget (-1: none, or no budget).
void choose(MemoryPlan& plan);
// The table, one line per candidate, the chosen one marked.
std::string format_plan(const MemoryPlan& plan, const std::string& program);
// The chosen candidate; throws std::invalid_argument naming the smallest need when nothing fits.
const Candidate& chosen(const MemoryPlan& plan);
std::string format_bytes(int64_t bytes);

namespace detail {
// The parameter, buffer and unit facts of `model`, and the other live bytes on `device` (no forward).
ModelFacts describe_model(torch::nn::Module& model, const ModelHooks& hooks, const TrainConfig& cfg,
                          const c10::Device& device);
// Every rank takes the largest of each measured figure (all ranks then choose alike). Collective.
void agree(ModelFacts& facts, const comm::ProcessGroup& pg);
// Every rank takes the figures of the rank whose candidate needs the most. Collective.
void agree_on_largest(Candidate& c, const comm::ProcessGroup& pg);
// Saves the default generators of the CPU and of `device`, restores them on destruction.
class RandomStateGuard {
 public:
  explicit RandomStateGuard(const c10::Device& device);
  ~RandomStateGuard();

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> rng_;
};
// Saves the default generators and the model's buffers, restores them on destruction (the measuring
// pass must not change what training does).
class MeasureGuard {
 public:
  MeasureGuard(torch::nn::Module& model, const c10::Device& device);
  ~MeasureGuard();

 private:
  RandomStateGuard rng_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> saved_;
};
// Whether a module of `model` is recomputed already (then the plain measurement recomputes).
bool recomputes(torch::nn::Module& model);
void zero_grads(torch::nn::Module& model);  // in place, keeping them allocated
void drop_grads(torch::nn::Module& model);  // undefined again, as before the measurement
// CPU: the peak RSS of a measured phase besides its counted tensors (Design note [memory plan],
// its RSS paragraph). start() gives the heap's free pages back (malloc_trim) and resets the peak RSS (VmHWM) to
// the RSS now; besides(peak) is then the phase's peak RSS minus `tensor_peak`, its counted peak:
// the libraries' code and buffers and what the heap held free at that peak. Where the peak RSS
// cannot be reset (Linux before 4.0) or read: RSS now minus the counted live bytes and the heap's
// free bytes, a lower bound. -1 off the CPU or without counted allocations.
class RssPeak {
 public:
  explicit RssPeak(const c10::Device& device);
  void start();
  int64_t besides(int64_t tensor_peak) const;

 private:
  bool counted_;  // a CPU device with counted allocations (util/memory.h)
  bool reset_ = false;
};
// This rank's first micro-batch as train::fit takes it (the DistributedSampler over the `dp`
// data-parallel ranks, epoch 0), on the session's device.
template <class Dataset>
std::pair<at::Tensor, at::Tensor> first_micro_batch(const Session& session, const Dataset& dataset, const TrainConfig& cfg,
                                                    int dp, int dp_rank) {
  data::DistributedSampler sampler(dataset.size(), data::DistributedSamplerOptions(dp, dp_rank).shuffle(true)
                                                       .seed(static_cast<int64_t>(cfg.seed)).drop_last(true));
  const std::vector<int64_t> order = sampler.indices();
  TORCH_CHECK(static_cast<int64_t>(order.size()) >= cfg.batch_size, "rank ", session.pg.rank(), ": the data (",
              dataset.size(), " samples) has no micro-batch of ", cfg.batch_size, " samples per rank to measure");
  auto [x, y] = dataset.batch(std::vector<int64_t>(order.begin(), order.begin() + cfg.batch_size));
  return {x.to(session.device), y.to(session.device)};
}
}  // namespace detail

// The model's facts with one micro-batch (x, y) measured: forward (under cfg's autocast) and
// backward, twice (the first allocates the gradients), the second's peak above the state before it;
// then again with hooks.recompute's modules recomputed (undone after). The random state and the
// model's buffers are as before; the gradients are dropped again.
template <class Model, class LossFn>
ModelFacts measure_model(Model& model, const at::Tensor& x, const at::Tensor& y, LossFn& loss_fn, const TrainConfig& cfg,
                         const ModelHooks& hooks, const c10::Device& device) {
  ModelFacts facts = detail::describe_model(*model, hooks, cfg, device);
  detail::MeasureGuard guard(*model, device);
  const int64_t live_at_start = util::live_bytes(device);
  auto pass = [&] {
    at::Tensor loss;
    {
      std::optional<amp::AutocastGuard> autocast;
      if (precision_of(cfg) != parallel::Precision::FP32) autocast.emplace(device.type(), compute_dtype(precision_of(cfg)));
      loss = loss_fn(model->forward(x), y);
    }
    loss.backward();
  };
  auto measure = [&] {
    pass();  // allocates the gradients
    detail::zero_grads(*model);
    util::reset_peak_bytes(device);
    detail::RssPeak rss(device);
    rss.start();
    const int64_t before = util::live_bytes(device);
    pass();
    const int64_t peak = util::peak_bytes(device);
    const int64_t extra = peak - before;
    facts.rss_besides_bytes = std::max(facts.rss_besides_bytes, rss.besides(peak));
    detail::zero_grads(*model);
    return extra;
  };
  facts.activation_bytes = measure();
  if (hooks.recompute && !detail::recomputes(*model)) {
    recompute::checkpoint_modules(*model, hooks.recompute);
    facts.recompute_activation_bytes = measure();
    recompute::stop_recomputing(*model);
  }
  detail::drop_grads(*model);
  // What the passes left allocated is made at first use and held from then on: on CUDA the cuBLAS
  // workspaces, one per thread and stream (the forward's, and the backward's in autograd's device
  // thread: 2 x 32 MiB on an H100 with 2.11), made in the first pass and so outside the measured
  // one. Every step holds it: it counts with the other live bytes. (Not on the CPU, where it is about
  // 0 and a collective's buffer still held by Gloo's worker thread would be counted as kept.)
  if (!device.is_cpu()) facts.other_bytes += std::max<int64_t>(0, util::live_bytes(device) - live_at_start);
  return facts;
}

// The model's facts on the session's ranks, measured on this rank's first micro-batch of `dataset`
// (as train::fit would take it: the DistributedSampler over the layout's data-parallel ranks, epoch
// 0; the ranks of one tensor-parallel group take the same samples), every rank taking the largest
// figures. Collective.
template <class Model, class Dataset, class LossFn>
ModelFacts measure_for(const Session& session, Model& model, const Dataset& dataset, LossFn& loss_fn, const TrainConfig& cfg,
                       const ModelHooks& hooks) {
  util::count_cpu_allocations();
  const int rank = session.pg.rank();
  if (cfg.init_on_ranks) {
    throw std::invalid_argument("the memory planner runs one micro-batch through the model, which --init-on-ranks builds "
                                "without values: plan without --init-on-ranks");
  }
  const int dp = hooks.groups ? hooks.groups->layout.data_parallel() : session.pg.size();
  const int dp_rank = hooks.groups ? hooks.groups->layout.data_parallel_rank(rank) : rank;
  const auto [x, y] = detail::first_micro_batch(session, dataset, cfg, dp, dp_rank);
  ModelFacts facts = measure_model(model, x, y, loss_fn, cfg, hooks, session.device);
  detail::agree(facts, session.pg);
  return facts;
}

// Pipeline parallelism (plan.layout.pipeline > 1): `model` put under `plan` by parallelize and two
// trial steps run on this rank's first micro-batch (the optimizer's state exists in the second);
// the candidate's peak is theirs, state counted from what the strategy holds, the rest as the
// step's; the rank with the most peak. The model is trained by them: build a fresh one to train.
// `running` is called once the layout is built (parallelize cut the stages), before the trial
// steps. Collective.
template <class Model, class Dataset, class LossFn, class Running>
Candidate measure_pipeline(const Session& session, Model model, const Dataset& dataset, LossFn loss_fn, const TrainConfig& cfg,
                           const parallel::Plan& plan, ModelHooks hooks, int64_t other_bytes, Running&& running) {
  util::count_cpu_allocations();
  const c10::Device device = session.device;
  if (!hooks.loss) hooks.loss = [loss_fn](const at::Tensor& out, const at::Tensor& y) mutable { return loss_fn(out, y); };
  if (!hooks.optimizer) hooks.optimizer = optimizer_factory(cfg);
  const parallel::Groups groups = hooks.groups ? *hooks.groups : make_groups(plan, session.pg);
  auto parallel = parallelize(model, plan, groups, hooks);
  running();
  Strategy& strategy = parallel.strategy();
  TORCH_CHECK(strategy.pipeline() != nullptr, "measure_pipeline: the plan has no pipeline (--pp > 1)");
  const auto [x, y] = detail::first_micro_batch(session, dataset, cfg, plan.data_parallel(),
                                                plan.layout.data_parallel_rank(session.pg.rank()));
  int64_t peak = 0;
  detail::RssPeak rss(device);
  rss.start();
  for (int trial = 0; trial < 2; ++trial) {
    strategy.zero_grad();
    util::reset_peak_bytes(device);
    {
      std::optional<amp::AutocastGuard> autocast;
      if (plan.precision != parallel::Precision::FP32) autocast.emplace(device.type(), compute_dtype(plan));
      strategy.pipeline()->step(x, y, 1.0);
    }
    strategy.after_backward();
    if (cfg.clip_grad_norm > 0) strategy.clip_grad_norm(cfg.clip_grad_norm);
    strategy.step();
    peak = std::max(peak, util::peak_bytes(device));
  }
  Candidate c{plan, plan.name()};
  for (const auto& g : strategy.grads_held()) {
    c.params += g.numel() * static_cast<int64_t>(g.element_size());
    if (g.grad().defined()) c.grads += g.grad().numel() * static_cast<int64_t>(g.grad().element_size());
  }
  c.optimizer = strategy.optimizer_state_bytes();
  c.other = other_bytes;
  c.step_extra = std::max<int64_t>(0, peak - c.params - c.grads - c.optimizer - c.other);
  c.rss_besides = rss.besides(peak);
  detail::agree_on_largest(c, session.pg);
  return c;
}

// The budget per rank: cfg's, or with --strategy auto and none given, util::default_budget_bytes
// (the least over the ranks). Collective.
int64_t budget_for(const Session& session, const TrainConfig& cfg);

// The data-parallel plan for `cfg` on the session's ranks, `model` measured by measure_for. Collective.
template <class Model, class Dataset, class LossFn>
MemoryPlan plan_for(const Session& session, Model& model, const Dataset& dataset, LossFn& loss_fn, const TrainConfig& cfg,
                    const ModelHooks& hooks) {
  const ModelFacts facts = measure_for(session, model, dataset, loss_fn, cfg, hooks);
  return plan_memory(cfg, session.pg.size(), facts, budget_for(session, cfg));
}


// --elastic --memory-budget SIZE (Design note [memory plan], its paragraph on membership changes):
// the facts every generation's plan is counted from, measured as this rank enters the job: among
// the first generation's ranks (collective, as measure_for), or by a joining rank on its own
// micro-batch (it has nobody to agree with yet; the check below takes the largest). None where
// nothing is checked (no --elastic or no budget). The model must not be under a plan yet.
template <class Model, class Dataset, class LossFn>
std::optional<ModelFacts> elastic_facts(const Session& session, Model& model, const Dataset& dataset, LossFn& loss_fn,
                                        const TrainConfig& cfg, const ModelHooks& hooks, const parallel::Plan& plan) {
  if (!cfg.elastic || cfg.memory_budget <= 0 || !counted(plan)) return std::nullopt;
  if (!session.elastic || !session.elastic->newcomer()) return measure_for(session, model, dataset, loss_fn, cfg, hooks);
  util::count_cpu_allocations();
  const auto [x, y] = detail::first_micro_batch(session, dataset, cfg, session.pg.size(), session.pg.rank());
  return measure_model(model, x, y, loss_fn, cfg, hooks, session.device);
}

// The largest of the session's ranks' counted peaks of `plan` (each from its own facts) against
// cfg.memory_budget: throws std::invalid_argument naming the plan, the world size, the need and the
// budget where it does not fit (every rank alike). Returns the peak. Collective.
int64_t check_elastic_budget(const Session& session, const TrainConfig& cfg, const parallel::Plan& plan,
                             const ModelFacts& facts);

}  // namespace dtrain::train
