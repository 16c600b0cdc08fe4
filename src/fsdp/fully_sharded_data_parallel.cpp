#include "dtrain/fsdp/fully_sharded_data_parallel.h"

// FullyShardedState, construction: the units a wrap policy picks, the flat parameters and their
// shards, the forward hooks (one iteration: iteration.cpp; shards and state dicts: state_access.cpp).

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "../internal/wrapper_common.h"
#include "dtrain/checkpoint/streaming_writer.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/fsdp/unit_plan.h"
#include "dtrain/nn/forward_hooks.h"
#include "dtrain/nn/hooked.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/util/system.h"

namespace dtrain::fsdp {

namespace {
parallel::Groups groups_for(const comm::ProcessGroup& pg, const FullyShardedOptions& options) {
  TORCH_CHECK(pg.is_member(), "FullyShardedDataParallel: this rank is not a member of the process group");
  return make_groups(pg, layout_for(options.sharding(), pg.size(), options.hybrid_layout()));
}
}  // namespace

FullyShardedState::FullyShardedState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg,
                                     FullyShardedOptions options)
    : FullyShardedState(std::move(module), groups_for(pg, options), options) {}

FullyShardedState::FullyShardedState(std::shared_ptr<torch::nn::Module> module, parallel::Groups groups,
                                     FullyShardedOptions options)
    : module_(std::move(module)), options_(std::move(options)), groups_(std::move(groups)) {
  TORCH_CHECK(module_, "FullyShardedDataParallel: no module given");
  const parallel::Layout& l = groups_.layout;
  const ShardingStrategy s = options_.sharding();
  TORCH_CHECK(s == ShardingStrategy::HybridShard || (s == ShardingStrategy::NoShard ? l.shard == 1 : l.replicate == 1),
              "FullyShardedDataParallel: sharding ", to_string(s), " does not go with the layout ", l.describe(),
              " (", to_string(s), " wants ", s == ShardingStrategy::NoShard ? "shard 1" : "replicate 1",
              "); use ShardingStrategy::HybridShard for replicas of shard groups");
  // The ranks that hold the same parameters: the world, or with tensor parallelism one tensor
  // rank's data-parallel ranks (Design note [TP inside FSDP], tensor_parallel/sharded.h).
  const comm::ProcessGroup& pg = groups_.data;
  TORCH_CHECK(options_.max_gathered_units() >= 1, describe(), " max_gathered_units must be >= 1, got ",
              options_.max_gathered_units());
  const Quantization& q = options_.quantization();
  TORCH_CHECK(!(q.gathers() || q.reductions()) || (q.block() > 0 && q.block() % 4 == 0), describe(),
              " quantization: the block must be a positive multiple of 4 elements, got ", q.block());
  // Quantized reduce-scatters over a shard group that spans nodes run in two levels (Design note
  // [block quantization], comm/quantized.h); secondary shards gather inside the node (Design note
  // [secondary shards], fsdp/secondary_shard.h).
  const bool by_node = q.reductions() || options_.secondary_shard() == SecondaryShard::Node;
  if (by_node && groups_.shard.size() > 1) groups_.shard_nodes = comm::split_by_node(groups_.shard);

  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) named.emplace_back(item.key(), item.value());
  // Design note [buffers reused] (util/block_pool.h): every block kept on the CPU, one per size on a GPU.
  const bool on_cpu = named.empty() || named[0].second.device().is_cpu();
  pool_ = std::make_unique<BlockPool>(on_cpu ? std::numeric_limits<size_t>::max() : size_t{1});
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) buffers_.emplace_back(item.key(), item.value());

  if (!options_.param_init_fn()) {
    // Same model on every rank (a clear error instead of a hang), then rank 0's values everywhere.
    internal::WrappedTensors t = internal::wrapped_tensors(*module_);
    internal::sync_module_states(pg, t, options_.sync_module_states() && pg.size() > 1, "FullyShardedDataParallel");
  }
  if (auto bd = options_.mixed_precision().buffer_dtype()) {
    at::NoGradGuard no_grad;
    for (auto& b : buffers_) {
      if (at::isFloatingType(b.second.scalar_type())) b.second.set_data(b.second.to(*bd));
    }
  }
  for (const auto& np : named) originals_.push_back(np.second.detach());
  build_units(named);
  materialize(named);
  // Design note [freed memory]: where a unit's gathered parameters reach 8 MiB.
  int64_t largest_unit = 0;
  for (const auto& u : units_) {
    int64_t bytes = 0;
    for (const auto& f : u->flats) bytes += f->full_bytes();
    largest_unit = std::max(largest_unit, bytes);
  }
  const int64_t threshold = options_.malloc_mmap_threshold();
  if (threshold > 0 || (threshold < 0 && largest_unit >= 8 * 1024 * 1024)) {
    util::fix_malloc_mmap_threshold(threshold > 0 ? threshold : 1024 * 1024);
  }
  install_hooks();
  reset_peak();
}

FullyShardedState::~FullyShardedState() {
  for (auto& u : units_) {
    if (u->forward_hook == 0) continue;
    if (auto* h = dynamic_cast<nn::Hookable*>(u->module)) h->forward_hooks().remove(u->forward_hook);
  }
}

void FullyShardedState::release_module() {
  for (auto& u : units_) {
    for (auto& f : u->flats) f->release();
    if (u->forward_hook == 0) continue;
    if (auto* h = dynamic_cast<nn::Hookable*>(u->module)) h->forward_hooks().remove(u->forward_hook);
    u->forward_hook = 0;
  }
}

const char* to_string(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::None: return "none";
    case BackwardPrefetch::BeforeBackward: return "before";
    case BackwardPrefetch::AfterBackward: return "after";
  }
  return "?";
}

BackwardPrefetch parse_backward_prefetch(const std::string& name) {
  if (name == "none") return BackwardPrefetch::None;
  if (name == "before") return BackwardPrefetch::BeforeBackward;
  if (name == "after") return BackwardPrefetch::AfterBackward;
  TORCH_CHECK(false, "unknown backward prefetch '", name, "': use before, after or none");
}

std::string FullyShardedState::describe() const {
  std::ostringstream s;
  s << groups_.world.describe() << " FullyShardedDataParallel(" << to_string(options_.sharding()) << ", "
    << groups_.layout.describe() << ")";
  return s.str();
}

// ---------------------------------------------------------------------------------------------
// Construction

void FullyShardedState::build_units(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  // Which modules are units and which unit owns each parameter (fsdp/unit_plan.h: the memory planner
  // counts from the same plan).
  UnitPlan plan = plan_units(*module_, options_.wrap_policy());
  auto& nodes = plan.nodes;
  // A nested unit gathers before its forward: it needs forward hooks. A stock layer in a Sequential
  // gets them in place (Design note [hooked modules]); otherwise a clear error. (Children first, as
  // the policy was asked.)
  for (size_t u = plan.unit_nodes.size(); u-- > 1;) {
    auto& node = nodes[plan.unit_nodes[u]];
    const std::string& name = node.name;
    const std::string key = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
    try {
      node.module = &nn::make_hookable(*nodes[node.parent].module, key, *node.module, name);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, describe(), ": the wrap policy picked ", e.what_without_backtrace(),
                  "; or choose a policy that skips it");
    }
  }
  TORCH_CHECK(!options_.wrap_policy().fn || plan.unit_nodes.size() > 1, describe(),
              ": the wrap policy picked no module of ", module_->name(), ", so the whole model would be one unit "
              "(gathered whole: nothing saved by sharding per layer). Pass WrapPolicy::none() if that is what you "
              "want, or a policy that matches the model's layers; only modules that can get forward hooks count "
              "(Hookable ones, dtrain::nn::Hooked<...> members, stock layers in a torch::nn::Sequential: Design note "
              "[hooked modules])");
  for (size_t u = 0; u < plan.unit_nodes.size(); ++u) {
    const auto& node = nodes[plan.unit_nodes[u]];
    auto unit = std::make_unique<Unit>();
    unit->name = node.name;
    unit->module = node.module;
    unit->parent = plan.unit_parents[u];
    unit->index = static_cast<int>(u);
    unit->reshard_after_forward = u > 0 && options_.sharding() != ShardingStrategy::ShardGradOp && groups_.layout.shard > 1;
    units_.push_back(std::move(unit));
  }
  const std::unordered_map<const void*, int>& owner = plan.owner;  // TensorImpl -> unit
  // FlatParams per unit, by (dtype, trainable), parameters in the model's order.
  struct Group {
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
  };
  std::vector<std::map<std::pair<int, bool>, Group>> groups(units_.size());
  std::unordered_set<const void*> seen;
  for (const auto& [name, p] : named) {
    const void* key = p.unsafeGetTensorImpl();
    if (!seen.insert(key).second) continue;  // a tied alias
    TORCH_CHECK(p.is_leaf(), describe(), ": parameter ", name, " is not a leaf tensor");
    TORCH_CHECK(at::isFloatingType(p.scalar_type()), describe(), ": parameter ", name, " has dtype ",
                p.scalar_type(), "; FSDP shards floating-point parameters only");
    const int u = owner.at(key);
    const std::pair<int, bool> g{static_cast<int>(p.scalar_type()), p.requires_grad()};
    groups[u][g].params.push_back(p);
    groups[u][g].names.push_back(name);
  }
  const auto& mp = options_.mixed_precision();
  for (size_t u = 0; u < units_.size(); ++u) {
    for (auto& [g, group] : groups[u]) {
      const auto dtype = static_cast<at::ScalarType>(g.first);
      const auto compute = mp.param_dtype().value_or(dtype);
      const auto reduce = mp.reduce_dtype().value_or(compute);
      units_[u]->flats.push_back(std::make_unique<FlatParam>(group.params, group.names, groups_, compute, reduce,
                                                             units_[u]->name.empty() ? "<root>" : units_[u]->name, pool_.get(),
                                                             options_.cpu_offload(), options_.quantization(),
                                                             options_.secondary_shard()));
      all_flats_.push_back(units_[u]->flats.back().get());
    }
  }
  // Every name (aliases too) -> its FlatParam entry.
  std::unordered_map<const void*, std::pair<FlatParam*, size_t>> entry_of;
  for (auto* f : all_flats_) {
    for (size_t e = 0; e < f->entries().size(); ++e) entry_of[f->entries()[e].param.unsafeGetTensorImpl()] = {f, e};
  }
  for (const auto& [name, p] : named) {
    const auto& [f, e] = entry_of.at(p.unsafeGetTensorImpl());
    named_.push_back({name, f, e});
  }
}

void FullyShardedState::materialize(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  // originals_ hold the values the module's tensors pointed at before FlatParam re-bound them
  // (placeholders with defer_init); each is dropped right after it is copied into its shards.
  std::unordered_map<const void*, bool> done;
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& np = named_[i];
    const auto& entry = np.flat->entries()[np.entry];
    const void* key = entry.param.unsafeGetTensorImpl();
    if (done[key]) continue;
    done[key] = true;
    at::Tensor value;
    if (options_.param_init_fn()) {
      value = at::empty(entry.shape, at::TensorOptions().dtype(np.flat->shard().scalar_type()));
      options_.param_init_fn()(np.name, value);
    } else {
      value = originals_.at(i);
    }
    np.flat->load(np.entry, value);
    originals_[i] = at::Tensor();
  }
  originals_.clear();
}

void FullyShardedState::install_hooks() {
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    Unit& u = *units_[ui];
    size_t index = 0;
    for (auto& f : u.flats) {
      if (!f->trainable()) continue;
      f->bind_stand_ins();  // full-shape stand-ins: accumulators record the right shape
      for (const auto& e : f->entries()) {
        u.grad_hooks.add(e.param, index++, [this, ui](size_t) { on_grad_ready(*units_[ui]); });
      }
      f->bind_placeholders();
    }
    u.expected_grads = index;
    if (ui == 0) continue;
    auto* hookable = dynamic_cast<nn::Hookable*>(u.module);
    u.forward_hook = hookable->forward_hooks().add(
        nn::HookOrder::Sharding, [this, ui](const nn::Tensors& in, const nn::ForwardBody& next) {
          pre_forward(*units_[ui]);
          nn::Tensors out = next(in);
          post_forward(*units_[ui], out);
          return out;
        });
  }
}

}  // namespace dtrain::fsdp
