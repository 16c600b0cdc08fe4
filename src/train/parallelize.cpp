// The non-template steps of train::parallelize (train/parallelize.h): what each composes is Design
// note [composed strategies] (train/strategy.h).
#include "dtrain/train/parallelize.h"

#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include "dtrain/optim/adamw.h"
#include <torch/optim/sgd.h>

#include "dtrain/comm/broadcast.h"
#include "dtrain/ddp/powersgd.h"
#include "dtrain/pipeline/sharded_stages.h"
#include "state/holding.h"
#include "state/optimizer_part.h"

namespace dtrain::train {

using parallel::DataParallel;

ModelHooks::OptimizerFactory optimizer_factory(const TrainConfig& cfg) {
  if (cfg.optimizer == "sgd") {
    // SGD decays only where asked (--weight-decay), AdamW by its default 0.01.
    const auto o = torch::optim::SGDOptions(cfg.lr).momentum(0.9).weight_decay(cfg.given.count("weight-decay") ? cfg.weight_decay : 0.0);
    return [o](std::vector<torch::optim::OptimizerParamGroup> groups) -> std::unique_ptr<torch::optim::Optimizer> {
      return std::make_unique<torch::optim::SGD>(std::move(groups), o);
    };
  }
  const auto o = torch::optim::AdamWOptions(cfg.lr).weight_decay(cfg.weight_decay).betas({cfg.beta1, cfg.beta2}).eps(cfg.eps);
  return [o](std::vector<torch::optim::OptimizerParamGroup> groups) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<optim::ForeachAdamW>(std::move(groups), o);  // Design note [multi-tensor AdamW]
  };
}

namespace detail {

void check_model(const parallel::Plan& plan, const torch::nn::Module& model) {
  if (plan.sequence_parallel && !tensor_parallel::has_sequence_parallel(model)) {
    throw std::invalid_argument("--sequence-parallel: the model has no layer built with sequence parallelism "
                                "(tensor_parallel::ParallelLinearOptions::sequence_parallel), so it would change "
                                "nothing: build the model's layers with it, or leave the flag out");
  }
}

void check_hooks(const parallel::Plan& plan, const parallel::Groups& groups, const ModelHooks& hooks) {
  const parallel::Layout& l = groups.layout;
  if (l.replicate != plan.layout.replicate || l.shard != plan.layout.shard || l.pipeline != plan.layout.pipeline ||
      l.tensor != plan.layout.tensor) {
    throw std::invalid_argument("the process groups were made for layout " + l.describe() + " but the plan is " +
                                plan.layout.describe() + ": make them with train::make_groups(plan, pg)");
  }
  if (!hooks.optimizer) {
    throw std::invalid_argument("train::parallelize needs the optimizer (ModelHooks::optimizer, e.g. "
                                "train::optimizer_factory(cfg))");
  }
  if (plan.layout.pipeline > 1 && !hooks.stages) {
    throw std::invalid_argument("--pp needs the program to say how its model is cut into stages (ModelHooks::stages; a "
                                "torch::nn::Sequential is cut at its children by default)");
  }
  if (plan.layout.pipeline > 1 && !hooks.loss) {
    throw std::invalid_argument("--pp needs the loss of the last stage (ModelHooks::loss)");
  }
  if (plan.data == DataParallel::FullShard && plan.layout.pipeline == 1 && plan.fsdp.per_layer && !hooks.wrap.fn) {
    throw std::invalid_argument("--wrap layer needs the program to say which modules are its layers "
                                "(ModelHooks::wrap, e.g. fsdp::WrapPolicy::by_type<Block>()); use --wrap none for one "
                                "unit");
  }
  if (plan.recompute && !hooks.recompute) {
    throw std::invalid_argument("--activation-checkpointing needs the program to say which modules to recompute "
                                "(ModelHooks::recompute, e.g. recompute::of_type<Block>())");
  }
  if (plan.fsdp.init_on_ranks && plan.data == DataParallel::FullShard && !hooks.param_init) {
    throw std::invalid_argument("--init-on-ranks needs the program's parameter initialiser (ModelHooks::param_init)");
  }
}

fsdp::FullyShardedOptions fsdp_options(const parallel::Plan& plan, const ModelHooks& hooks) {
  static const fsdp::ShardingStrategy shardings[] = {fsdp::ShardingStrategy::FullShard, fsdp::ShardingStrategy::ShardGradOp,
                                                     fsdp::ShardingStrategy::NoShard, fsdp::ShardingStrategy::HybridShard};
  const parallel::FullShardOptions& f = plan.fsdp;
  auto opts = fsdp::FullyShardedOptions().sharding(shardings[static_cast<int>(f.sharding)]);
  if (f.per_layer) opts.wrap_policy(hooks.wrap);
  switch (f.backward_prefetch) {
    case parallel::Prefetch::Before: opts.backward_prefetch(fsdp::BackwardPrefetch::BeforeBackward); break;
    case parallel::Prefetch::After: opts.backward_prefetch(fsdp::BackwardPrefetch::AfterBackward); break;
    case parallel::Prefetch::None: opts.backward_prefetch(fsdp::BackwardPrefetch::None); break;
    case parallel::Prefetch::Default: break;
  }
  if (f.overlap_reduction >= 0) opts.overlap_reduction(f.overlap_reduction == 1);
  if (f.max_gathered_units > 0) opts.max_gathered_units(f.max_gathered_units);
  if (plan.precision != parallel::Precision::FP32) {
    // bf16 or fp16: gathered parameters (so forward and backward) in that dtype, gradients reduced
    // in fp32 (Design note [fp32 reduction], session.h), outputs returned in fp32.
    opts.mixed_precision(fsdp::MixedPrecision().param_dtype(compute_dtype(plan)).reduce_dtype(at::kFloat)
                             .output_dtype(at::kFloat));
  }
  // Master shards, gradients and optimizer state on the CPU; a no-op for a model on the CPU.
  opts.cpu_offload(f.cpu_offload);
  if (f.init_on_ranks) opts.param_init_fn(hooks.param_init);
  // Block-quantized int8 or fp8 on the wire (Design notes [block quantization], [fp8 blocks],
  // comm/quantized.h).
  opts.quantization(fsdp::Quantization().gathers(f.gather_quant != parallel::Quant::None)
                        .gather_format(f.gather_quant == parallel::Quant::Fp8 ? comm::QuantFormat::Fp8
                                                                              : comm::QuantFormat::Int8)
                        .reductions(f.reduce_quant == parallel::Quant::Int8));
  // The backward's gathers inside the node (Design note [secondary shards], fsdp/secondary_shard.h).
  opts.secondary_shard(f.secondary_shard ? fsdp::SecondaryShard::Node : fsdp::SecondaryShard::None);
  return opts;
}

std::shared_ptr<ddp::CommHook> comm_hook_of(const parallel::Plan& plan) {
  const parallel::CompressionOptions& c = plan.compression;
  switch (c.kind) {
    case parallel::Compression::None: return nullptr;
    case parallel::Compression::BF16: return ddp::cast_hook(at::kBFloat16);
    case parallel::Compression::FP16: return ddp::cast_hook(at::kHalf);
    case parallel::Compression::PowerSGD:
      return ddp::powersgd_hook(ddp::PowerSGDOptions().rank(c.rank).warmup_steps(c.warmup_steps));
  }
  return nullptr;
}

c10::optional<at::ScalarType> wire_dtype_of(const parallel::Plan& plan) {
  switch (plan.compression.kind) {
    case parallel::Compression::BF16: return at::kBFloat16;
    case parallel::Compression::FP16: return at::kHalf;
    default: return c10::nullopt;  // (PowerSGD is refused for zero2 by the plan)
  }
}

int64_t local_devices(const torch::nn::Module& model, const parallel::Plan& plan) {
  const auto params = model.parameters();
  const bool cuda = !params.empty() && params.front().is_cuda();
  const int64_t gpus = cuda ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  if (gpus < 2) return gpus;
  if (plan.recompute) {
    throw std::invalid_argument("--strategy dp replicates the model at every forward and the replicas carry no "
                                "recomputation hooks: drop --activation-checkpointing, or use --strategy ddp");
  }
  try {
    (void)model.clone();
  } catch (const c10::Error& e) {
    throw std::invalid_argument("--strategy dp replicates the model with clone(), which " + model.name() +
                                " does not have: derive it from torch::nn::Cloneable<" + model.name() +
                                "> (and implement reset()), or use --strategy ddp");
  }
  return gpus;
}

namespace {
Cut cut_of(const Strategy& s) {
  if (s.plan().layout.tensor == 1) return std::nullopt;
  return tensor_parallel::Plan::of(*s.model(), s.groups().tensor);
}

std::unique_ptr<OptimizerPart> optimizer_over(const Strategy& s, std::vector<at::Tensor> params, const ModelHooks& hooks) {
  const parallel::Groups& g = s.groups();
  if (s.plan().shards_optimizer()) return OptimizerPart::sharded(std::move(params), g.data, hooks.optimizer);
  return OptimizerPart::replicated(std::move(params), hooks.optimizer, g.data.rank());
}

std::vector<at::Tensor> tensors_of(const NamedTensors& named) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t);
  return out;
}
}  // namespace

void hold_tensors(Strategy& s, const ModelHooks& hooks) {
  const NamedTensors params = named_parameters(*s.model());
  auto optimizer = optimizer_over(s, tensors_of(unique_tensors(params)), hooks);
  s.set_parts(std::move(optimizer), tensor_holding(s.model(), params, named_buffers(*s.model()), s.groups(), cut_of(s), nullptr));
}

void hold_shards(Strategy& s, fsdp::FullyShardedState& state, std::vector<at::Tensor> shards, const ModelHooks& hooks) {
  auto optimizer = OptimizerPart::replicated(std::move(shards), hooks.optimizer, 0);
  s.set_parts(std::move(optimizer), fsdp_holding(s.model(), state, s.groups(), cut_of(s)));
}

void build_pipeline(Strategy& s, std::vector<pipeline::Stage> stages, const ModelHooks& hooks) {
  const parallel::Plan& plan = s.plan();
  const parallel::Groups& g = s.groups();
  const bool sharded = plan.data == DataParallel::FullShard;
  if (sharded) {  // a stage's first forward of a step gathers this rank's stages (Design note [sharded stages])
    for (auto& stage : stages) {
      stage.forward = [st = &s, f = std::move(stage.forward)](const at::Tensor& x) {
        st->sharded_stages()->gather();
        return f(x);
      };
    }
  }
  s.set_pipeline(std::make_unique<pipeline::Pipeline>(
      std::move(stages), g.pipeline, hooks.loss,
      pipeline::PipelineOptions().schedule(parallel::to_string(plan.pipeline.schedule))
          .microbatches(plan.pipeline.microbatches).virtual_stages(plan.pipeline.virtual_stages)));
  pipeline::Pipeline& pipe = *s.pipeline();
  // A stage's data-parallel replicas start from data rank 0's values (as DDP's broadcast).
  for (auto& p : pipe.parameters()) {
    at::Tensor t = p.detach();
    if (g.data.size() > 1) comm::broadcast(g.data, t, comm::BroadcastOptions().src(0));
  }
  const Cut cut = cut_of(s);  // (read before the other stages are released)
  auto whole = std::make_unique<WholeModel>(s.model(), pipe.parameters(), g);
  NamedTensors buffers;
  for (const auto& stage : pipe.stages()) {
    for (const auto& b : named_buffers(*stage.module)) buffers.push_back(b);
  }
  if (sharded) {  // parameters, gradients and optimizer state sharded; gradients reduce-scattered once a step
    s.set_sharded_stages(std::make_unique<pipeline::ShardedStages>(pipe.stages(), g));
    pipeline::ShardedStages* st = s.sharded_stages();
    auto optimizer = OptimizerPart::replicated(st->trainable_shards(), hooks.optimizer, 0);
    s.set_parts(std::move(optimizer), stages_holding(*st, std::move(buffers), g, cut, std::move(whole)));
    s.set_after_backward([st] { st->reduce_gradients(); });
    return;
  }
  // replicated or ZeRO-1: every stage gradient averaged over the data-parallel group once a step
  const NamedTensors params = pipe.named_parameters();
  auto optimizer = optimizer_over(s, tensors_of(params), hooks);
  s.set_parts(std::move(optimizer), tensor_holding(s.model(), params, std::move(buffers), g, cut, std::move(whole)));
  s.set_after_backward([st = &s] { pipeline::average_gradients(st->pipeline()->parameters(), st->groups().data); });
}

}  // namespace detail
}  // namespace dtrain::train
