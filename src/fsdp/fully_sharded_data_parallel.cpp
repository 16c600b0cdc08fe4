#include "dtrain/fsdp/fully_sharded_data_parallel.h"

#include <algorithm>
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
#include "dtrain/nn/forward_hooks.h"
#include "dtrain/nn/hooked.h"
#include "dtrain/optim/clip_grad.h"
#include "dtrain/util/system.h"

namespace dtrain::fsdp {

namespace {

// The module tree, walked once: each module's name, parent and direct parameters.
struct ModuleNode {
  std::string name;
  torch::nn::Module* module;
  int parent;
  int unit = -1;  // the unit it starts (if any)
};

void walk(torch::nn::Module& m, const std::string& name, int parent, std::vector<ModuleNode>& out) {
  const int me = static_cast<int>(out.size());
  out.push_back({name, &m, parent});
  for (const auto& child : m.named_children()) {
    walk(*child.value(), name.empty() ? child.key() : name + "." + child.key(), me, out);
  }
}

}  // namespace

FullyShardedState::FullyShardedState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg,
                                     FullyShardedOptions options)
    : module_(std::move(module)), options_(std::move(options)) {
  TORCH_CHECK(module_, "FullyShardedDataParallel: no module given");
  TORCH_CHECK(pg.is_member(), "FullyShardedDataParallel: this rank is not a member of the process group");
  groups_ = make_groups(pg, layout_for(options_.sharding(), pg.size(), options_.hybrid_layout()));
  TORCH_CHECK(options_.max_gathered_units() >= 1, describe(), " max_gathered_units must be >= 1, got ",
              options_.max_gathered_units());
  pool_ = std::make_unique<BlockPool>(/*keep_per_size=*/1);

  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) named.emplace_back(item.key(), item.value());
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
  std::vector<ModuleNode> nodes;
  walk(*module_, "", -1, nodes);
  // Bottom-up (children come after their parent in `nodes`): count parameters not yet wrapped and
  // ask the policy; a picked module contributes nothing to its parent.
  std::vector<int64_t> unwrapped(nodes.size(), 0);
  std::vector<char> is_unit(nodes.size(), 0);
  is_unit[0] = 1;
  for (size_t i = nodes.size(); i-- > 0;) {
    for (const auto& p : nodes[i].module->named_parameters(/*recurse=*/false)) unwrapped[i] += p.value().numel();
    const auto& policy = options_.wrap_policy();
    if (i > 0 && policy.fn && (!policy.skip_unhookable || nn::can_hook_in(*nodes[nodes[i].parent].module, *nodes[i].module)) &&
        policy.fn(nodes[i].name, *nodes[i].module, unwrapped[i])) {
      // A nested unit gathers before its forward: it needs forward hooks. A stock layer in a
      // Sequential gets them in place (Design note [hooked modules]); otherwise a clear error.
      const std::string& name = nodes[i].name;
      const std::string key = name.substr(name.rfind('.') == std::string::npos ? 0 : name.rfind('.') + 1);
      try {
        nodes[i].module = &nn::make_hookable(*nodes[nodes[i].parent].module, key, *nodes[i].module, name);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, describe(), ": the wrap policy picked ", e.what_without_backtrace(),
                    "; or choose a policy that skips it");
      }
      is_unit[i] = 1;
    }
    if (i > 0 && !is_unit[i]) unwrapped[nodes[i].parent] += unwrapped[i];
  }
  TORCH_CHECK(!options_.wrap_policy().fn || std::count(is_unit.begin(), is_unit.end(), 1) > 1, describe(),
              ": the wrap policy picked no module of ", module_->name(), ", so the whole model would be one unit "
              "(gathered whole: nothing saved by sharding per layer). Pass WrapPolicy::none() if that is what you "
              "want, or a policy that matches the model's layers; only modules that can get forward hooks count "
              "(Hookable ones, dtrain::nn::Hooked<...> members, stock layers in a torch::nn::Sequential: Design note "
              "[hooked modules])");
  // Units in pre-order; each module's enclosing unit.
  std::vector<int> enclosing(nodes.size(), -1);
  for (size_t i = 0; i < nodes.size(); ++i) {
    const int up = nodes[i].parent < 0 ? -1 : enclosing[nodes[i].parent];
    if (is_unit[i]) {
      auto u = std::make_unique<Unit>();
      u->name = nodes[i].name;
      u->module = nodes[i].module;
      u->parent = up;
      u->index = static_cast<int>(units_.size());
      u->reshard_after_forward = i > 0 && options_.sharding() != ShardingStrategy::ShardGradOp &&
                                 groups_.layout.shard > 1;
      enclosing[i] = static_cast<int>(units_.size());
      units_.push_back(std::move(u));
    } else {
      enclosing[i] = up;
    }
  }
  // Each distinct parameter goes to the innermost unit enclosing all modules that hold it.
  auto lca = [&](int a, int b) {
    auto depth = [&](int u) {
      int d = 0;
      for (; units_[u]->parent >= 0; u = units_[u]->parent) ++d;
      return d;
    };
    int da = depth(a), db = depth(b);
    for (; da > db; --da) a = units_[a]->parent;
    for (; db > da; --db) b = units_[b]->parent;
    while (a != b) {
      a = units_[a]->parent;
      b = units_[b]->parent;
    }
    return a;
  };
  std::unordered_map<const void*, int> owner;  // TensorImpl -> unit
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const auto& p : nodes[i].module->named_parameters(/*recurse=*/false)) {
      const void* key = p.value().unsafeGetTensorImpl();
      auto it = owner.find(key);
      owner[key] = it == owner.end() ? enclosing[i] : lca(it->second, enclosing[i]);
    }
  }
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
                                                             options_.cpu_offload()));
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

// ---------------------------------------------------------------------------------------------
// One iteration. Phase: Idle -> Forward (root forward) -> Backward (first hook of its backward)
// -> Idle (end_of_backward, queued on the autograd engine). Unit states: see unit.h.

void FullyShardedState::gather(Unit& u, bool wait) {
  for (auto& f : u.flats) {
    if (f->state() == FlatParam::State::Sharded) {
      f->gather_async();
      if (groups_.layout.shard > 1) ++stats_.all_gathers;
    }
  }
  if (!wait) return;
  for (auto& f : u.flats) f->wait_gather();
  note_memory();
}

void FullyShardedState::reshard(Unit& u) {
  for (auto& f : u.flats) f->reshard();
}

int FullyShardedState::gathered_nested_units() const {
  int n = 0;
  for (size_t i = 1; i < units_.size(); ++i) {
    const Unit& u = *units_[i];
    if (!u.flats.empty() && u.reshard_after_forward && (u.gathered() || u.gathering())) ++n;
  }
  return n;
}

void FullyShardedState::prefetch(const std::vector<int>& order, int after) {
  // `after` is a position in `order` (-1: before its first unit); the unit after it is prefetched.
  if (after < -1 || after + 1 >= static_cast<int>(order.size())) return;
  Unit& next = *units_[order[after + 1]];
  if (order[after + 1] == 0 || next.flats.empty() || next.gathered() || next.gathering()) return;
  if (gathered_nested_units() >= options_.max_gathered_units()) return;
  gather(next, /*wait=*/false);
  note_memory();  // its full buffer is allocated now
}

void FullyShardedState::prefetch_backward(const Unit& u) {
  // Backward runs the units in reverse forward order: after the root (not in forward_order_) the
  // last unit of forward, after any other unit the one that entered its forward just before it.
  if (u.index == 0) {
    prefetch(forward_order_, static_cast<int>(forward_order_.size()) - 2);
    return;
  }
  for (int i = static_cast<int>(forward_order_.size()) - 1; i > 0; --i) {
    if (forward_order_[i] == u.index) {
      prefetch(forward_order_, i - 2);
      return;
    }
  }
}

void FullyShardedState::finish_reductions(const Unit* except) {
  for (auto* f : all_flats_) {
    bool mine = false;
    if (except) {
      for (auto& g : except->flats) mine |= g.get() == f;
    }
    if (!mine && f->reducing()) f->finish_reduce();
  }
}

void FullyShardedState::finish_leftover_iteration() {
  // A forward whose backward never came (evaluation, or a loss that was not backpropagated).
  for (auto& u : units_) {
    reshard(*u);
    u->to(Unit::State::Idle);
    u->ready_grads = 0;
  }
  if (!forward_order_.empty()) last_forward_order_ = forward_order_;
  forward_order_.clear();
  phase_ = Phase::Idle;
}

void FullyShardedState::before_forward() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(phase_ != Phase::Backward, describe(), ": a forward started while the previous backward was still "
              "running; finish backward() first");
  if (phase_ == Phase::Forward) {
    // A second forward before backward (e.g. two losses summed): units re-gather in backward.
    for (auto& u : units_) {
      reshard(*u);
      u->to(Unit::State::Idle);
    }
  } else {
    for (auto& u : units_) u->ready_grads = 0;
    forward_order_.clear();
    synced_iteration_ = sync_;
  }
  phase_ = Phase::Forward;
  Unit& root = *units_[0];
  gather(root, /*wait=*/true);
  root.to(Unit::State::Forward);
  if (options_.forward_prefetch()) prefetch(last_forward_order_, -1);
}

void FullyShardedState::after_forward(const std::vector<at::Tensor>& outs) {
  std::lock_guard<std::mutex> lock(mu_);
  Unit& root = *units_[0];
  root.to(Unit::State::Forwarded);
  bool backward_follows = false;
  for (const auto& o : outs) backward_follows |= at::GradMode::is_enabled() && o.defined() && o.requires_grad();
  if (!backward_follows) {
    finish_leftover_iteration();
    return;
  }
  // The first output whose gradient arrives starts the root's backward (pre_backward runs once).
  for (const auto& o : outs) {
    if (o.defined() && o.requires_grad()) const_cast<at::Tensor&>(o).register_hook([this](const at::Tensor&) { pre_backward(*units_[0]); });
  }
}

at::Tensor FullyShardedState::after_forward(at::Tensor out) {
  std::lock_guard<std::mutex> lock(mu_);
  Unit& root = *units_[0];
  root.to(Unit::State::Forwarded);
  const bool backward_follows = at::GradMode::is_enabled() && out.defined() && out.requires_grad();
  if (!backward_follows) {
    finish_leftover_iteration();
  } else {
    out.register_hook([this](const at::Tensor&) { pre_backward(*units_[0]); });
  }
  if (auto dt = options_.mixed_precision().output_dtype()) {
    if (out.defined() && at::isFloatingType(out.scalar_type()) && out.scalar_type() != *dt) out = out.to(*dt);
  }
  return out;
}

void FullyShardedState::pre_forward(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Backward) {
    // A recomputation in backward (checkpointing outside FSDP): gather, keep until post-backward.
    gather(u, /*wait=*/true);
    return;
  }
  TORCH_CHECK(phase_ == Phase::Forward, describe(), ": unit ", u.name, " ran outside the wrapped model's forward; "
              "call the FullyShardedDataParallel wrapper's forward, not the inner module's");
  forward_order_.push_back(u.index);
  gather(u, /*wait=*/true);
  u.to(Unit::State::Forward);
  if (options_.forward_prefetch() && last_forward_order_.size() >= forward_order_.size()) {
    prefetch(last_forward_order_, static_cast<int>(forward_order_.size()) - 1);
  }
}

void FullyShardedState::post_forward(Unit& u, const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Backward) return;  // a recomputation: parameters stay for this backward
  u.to(Unit::State::Forwarded);
  bool backward_follows = false;
  for (const auto& o : outputs) backward_follows |= o.defined() && o.requires_grad();
  backward_follows &= at::GradMode::is_enabled();
  if (u.reshard_after_forward || !at::GradMode::is_enabled()) reshard(u);
  if (!backward_follows) return;
  Unit* up = &u;
  for (const auto& o : outputs) {
    if (o.defined() && o.requires_grad()) {
      const_cast<at::Tensor&>(o).register_hook([this, up](const at::Tensor&) { pre_backward(*up); });
    }
  }
}

void FullyShardedState::start_backward_round() {
  if (phase_ == Phase::Backward) return;
  phase_ = Phase::Backward;
  util::queue_end_of_backward([this] { end_of_backward(); });
}

// Design note [backward memory]
// ------------------------------
// In backward, unit k needs its full parameters (4 B x P_k in fp32) and a flat gradient buffer of
// the same size; beyond that and the shards, what a rank holds depends on how much communication
// is to overlap computation (the root, gathered from its forward to the end of backward because
// its embeddings get their gradients last, adds its own parameters and gradients throughout):
//
//   backward_prefetch  overlap_reduction  held in unit k's backward           overlapped with compute
//   BeforeBackward     true (default)     params k, k-1; grads k, k+1: 16 B   gather k-1, reduce k+1
//   None               true               params k; grads k, k+1:      12 B   reduce k+1
//   AfterBackward      true               params k; grads k, k+1:      12 B   reduce k+1
//   BeforeBackward     false              params k, k-1; grads k:      12 B   gather k-1
//   AfterBackward      false              params k; grads k:            8 B   nothing (lean)
//   None               false              params k; grads k:            8 B   nothing
//
// AfterBackward issues gather k-1 at k's post-backward, right after k's parameters are freed and
// k's reduce-scatter launched, so the two collectives are in flight together (Gloo runs them on
// the process group's two worker threads; NCCL queues them on the group's stream) before k-1's
// computation starts; with
// overlap_reduction false, k-1's pre-backward then finishes reduce k before it allocates k-1's
// gradient buffer, which takes the block reduce k just returned to the BlockPool. That is the
// "memory-lean" backward: the peak is the shards plus one unit's parameters and gradients, the
// root's, and one reduce-scatter output (1/S of a unit), within 1.1x of 16 B x P / W + 8 B x the
// largest unit for the benchmark's GPTs. It costs the overlap: the default keeps it, for speed.
// Figures: bench/README.md (FSDP); the counts above are checked by tests/fsdp/runtime_test.cpp
// (FsdpBackwardMemory).

void FullyShardedState::pre_backward(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  start_backward_round();
  if (u.state == Unit::State::BackwardPre || u.state == Unit::State::Reduced) return;
  gather(u, /*wait=*/true);
  u.to(Unit::State::BackwardPre);
  // The root stays gathered through the whole backward: AfterBackward's only chance to prefetch
  // the first nested unit is here (Design note [backward memory]).
  const auto bp = options_.backward_prefetch();
  if (bp == BackwardPrefetch::BeforeBackward || (bp == BackwardPrefetch::AfterBackward && u.index == 0)) {
    prefetch_backward(u);  // before finishing reductions: the gather overlaps them
  }
  if (!options_.overlap_reduction()) finish_reductions(&u);
  for (auto& f : u.flats) f->bind_grad_slots();
  note_memory();
}

void FullyShardedState::on_grad_ready(Unit& u) {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ == Phase::Idle) return;  // a backward FSDP did not prepare (no forward through the wrapper)
  start_backward_round();
  if (u.state != Unit::State::BackwardPre && u.state != Unit::State::Reduced) u.to(Unit::State::BackwardPre);
  if (++u.ready_grads != u.expected_grads) return;
  post_backward(u);
  // After u's parameters were freed and its reduction launched (Design note [backward memory]);
  // the root's post-backward ends the backward (it prefetched at its pre-backward).
  if (options_.backward_prefetch() == BackwardPrefetch::AfterBackward && u.index != 0) prefetch_backward(u);
}

void FullyShardedState::post_backward(Unit& u) {
  if (u.state == Unit::State::Reduced) return;
  // Serial reductions: the previous one ends before this one starts, also where no other unit's
  // pre-backward came in between (the root's, at the very end).
  if (!options_.overlap_reduction()) finish_reductions(&u);
  for (auto& f : u.flats) {
    if (!f->trainable()) continue;
    if (synced_iteration_) {
      f->reduce_grads_async();
      if (groups_.world.size() > 1) ++stats_.reduce_scatters;
    }
    f->reshard();  // frozen FlatParams stay gathered until the end of backward (they have no signal)
  }
  u.to(Unit::State::Reduced);
  note_memory();
  // At most one unit's reduction in flight (as FSDP2): finish the earlier ones, so their
  // gradient buffers do not pile up over the backward.
  finish_reductions(&u);
}

void FullyShardedState::end_of_backward() {
  std::lock_guard<std::mutex> lock(mu_);
  // Units whose gradients did not all arrive (unused parameters): reduce what they have, in unit
  // order (the same on every rank).
  for (auto& u : units_) {
    if (u->state != Unit::State::Idle && u->state != Unit::State::Reduced && u->expected_grads > 0) post_backward(*u);
  }
  finish_reductions(nullptr);
  note_memory();
  for (auto& u : units_) {
    reshard(*u);
    u->to(Unit::State::Idle);
    u->ready_grads = 0;
  }
  last_forward_order_ = forward_order_;
  forward_order_.clear();
  phase_ = Phase::Idle;
}

// ---------------------------------------------------------------------------------------------
// Shards, clipping, state dicts

std::vector<at::Tensor> FullyShardedState::trainable_shards() const {
  std::vector<at::Tensor> out;
  for (auto* f : all_flats_) {
    if (f->trainable()) out.push_back(f->shard());
  }
  return out;
}

std::vector<at::Tensor> FullyShardedState::shards() const {
  std::vector<at::Tensor> out;
  for (auto* f : all_flats_) out.push_back(f->shard());
  return out;
}

std::vector<ShardSlice> FullyShardedState::slices() const {
  std::vector<ShardSlice> out;
  for (const auto& np : named_) {
    const FlatParam& f = *np.flat;
    auto [b, e] = f.local_range(np.entry);
    if (e == b) continue;
    const size_t flat = std::find(all_flats_.begin(), all_flats_.end(), np.flat) - all_flats_.begin();
    const auto& entry = f.entries()[np.entry];
    out.push_back({np.name, entry.shape, b, e - b, flat, entry.offset + b - f.shard_begin()});
  }
  return out;
}

std::vector<FullyShardedState::ParamInfo> FullyShardedState::parameter_infos() const {
  std::vector<ParamInfo> out;
  for (const auto& np : named_) {
    out.push_back({np.name, np.flat->entries()[np.entry].shape, np.flat->shard().scalar_type()});
  }
  return out;
}

double FullyShardedState::clip_grad_norm(double max_norm, double norm_type) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": clip_grad_norm during forward/backward; call it after backward()");
  // Within a shard group every element is held by exactly one rank (padding has zero gradient);
  // replicas hold the same shards, so the shard group alone gives the global norm.
  return optim::clip_grad_norm(groups_.shard, trainable_shards(), max_norm, norm_type);
}

at::Tensor FullyShardedState::gather_master(const FlatParam& f) const {
  const auto opts = f.shard().options().requires_grad(false);
  if (groups_.layout.shard == 1) return f.shard().detach().clone();
  // On the group's device (offloaded shards go there and back).
  const auto dev = groups_.shard.device();
  at::Tensor full = at::empty({f.chunk() * groups_.layout.shard}, opts.device(dev));
  comm::all_gather(groups_.shard, full, f.shard().detach().to(dev));
  return full.to(opts.device());
}

torch::OrderedDict<std::string, at::Tensor> FullyShardedState::full_state_dict(int rank) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": full_state_dict during forward/backward");
  TORCH_CHECK(rank >= 0 && rank < groups_.world.size(), describe(), ": full_state_dict rank ", rank, " out of range");
  const bool keep = groups_.world.rank() == rank;
  std::vector<at::Tensor> values(named_.size());
  for (auto* f : all_flats_) {
    at::Tensor full = gather_master(*f);  // one unit's FlatParam at a time
    if (!keep) continue;
    for (size_t i = 0; i < named_.size(); ++i) {
      if (named_[i].flat != f) continue;
      const auto& e = f->entries()[named_[i].entry];
      values[i] = full.narrow(0, e.offset, e.numel).view(e.shape).clone();
    }
  }
  torch::OrderedDict<std::string, at::Tensor> out;
  if (!keep) return out;
  for (size_t i = 0; i < named_.size(); ++i) out.insert(named_[i].name, values[i]);
  for (const auto& [name, b] : buffers_) out.insert(name, b.detach().clone());
  return out;
}

void FullyShardedState::load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": load_full_state_dict during forward/backward");
  // Check everything before changing anything.
  for (const auto& np : named_) {
    const auto* v = dict.find(np.name);
    TORCH_CHECK(v, describe(), " load_full_state_dict: missing key ", np.name);
    const auto& e = np.flat->entries()[np.entry];
    TORCH_CHECK(v->sizes().vec() == e.shape, describe(), " load_full_state_dict: ", np.name, " has shape ",
                v->sizes(), ", the model ", c10::IntArrayRef(e.shape));
  }
  for (const auto& [name, b] : buffers_) {
    const auto* v = dict.find(name);
    TORCH_CHECK(v && v->sizes() == b.sizes(), describe(), " load_full_state_dict: buffer ", name,
                v ? " has the wrong shape" : " is missing");
  }
  for (auto& u : units_) reshard(*u);
  for (const auto& np : named_) np.flat->load(np.entry, dict[np.name]);
  at::NoGradGuard no_grad;
  for (auto& [name, b] : buffers_) b.copy_(dict[name]);
}

std::string FullyShardedState::export_full_weights(const std::string& path, int rank,
                                                   std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": export_full_weights during forward/backward");
  TORCH_CHECK(rank >= 0 && rank < groups_.world.size(), describe(), ": export_full_weights rank ", rank, " out of range");
  const bool mine = groups_.world.rank() == rank;
  std::unique_ptr<checkpoint::StreamingWriter> writer;
  if (mine) {
    std::vector<checkpoint::TensorSpec> specs;
    for (auto* f : all_flats_) {
      for (const auto& e : f->entries()) specs.push_back({e.name, e.shape, dtype.value_or(f->shard().scalar_type())});
    }
    for (const auto& [name, b] : buffers_) specs.push_back({name, b.sizes().vec(), b.scalar_type()});
    writer = std::make_unique<checkpoint::StreamingWriter>(path, std::move(specs));
  }
  for (auto* f : all_flats_) {
    at::Tensor full = gather_master(*f);
    if (!mine) continue;
    for (const auto& e : f->entries()) {
      at::Tensor v = full.narrow(0, e.offset, e.numel);
      writer->write(e.name, dtype ? v.to(*dtype) : v);
    }
  }
  if (!mine) return "";
  for (const auto& [name, b] : buffers_) writer->write(name, b.detach());
  return writer->finish().path;
}

std::vector<checkpoint::Piece> FullyShardedState::sharded_state_dict(const std::string& prefix) const {
  std::vector<checkpoint::Piece> out;
  // Replicas (HybridShard, NoShard) hold equal shards: the first replica writes them, so every
  // element is written once.
  const bool writes_shards = groups_.replicate.rank() == 0;
  for (const auto& np : named_) {
    if (!writes_shards) break;
    auto [b, e] = np.flat->local_range(np.entry);
    if (e == b) continue;
    out.push_back({prefix + np.name, np.flat->entries()[np.entry].shape, b, np.flat->local_part(np.entry)});
  }
  for (const auto& [name, buf] : buffers_) {
    if (auto p = checkpoint::replicated_piece(prefix + name, buf.detach(), groups_.world.rank(), groups_.world.size())) {
      out.push_back(std::move(*p));
    }
  }
  return out;
}

void FullyShardedState::load_sharded_state_dict(const RangeReader& read, const std::string& prefix) {
  TORCH_CHECK(phase_ == Phase::Idle, describe(), ": load_sharded_state_dict during forward/backward");
  for (auto& u : units_) reshard(*u);
  at::NoGradGuard no_grad;
  for (const auto& np : named_) {
    auto [b, e] = np.flat->local_range(np.entry);
    if (e == b) continue;
    at::Tensor v = read(prefix + np.name, b, e);
    TORCH_CHECK(v.numel() == e - b, describe(), " load_sharded_state_dict: ", prefix + np.name, " [", b, ", ", e,
                ") came back with ", v.numel(), " elements");
    np.flat->local_part(np.entry).copy_(v.reshape({-1}));
  }
  for (auto& [name, buf] : buffers_) buf.copy_(read(prefix + name, 0, buf.numel()).view(buf.sizes()));
}

FullyShardedState::GatheredGuard::GatheredGuard(FullyShardedState* s) : s_(s) {
  TORCH_CHECK(s_->phase_ == Phase::Idle, s_->describe(), ": gather_full_params during forward/backward");
  for (auto& u : s_->units_) s_->gather(*u, /*wait=*/false);
  for (auto& u : s_->units_) s_->gather(*u, /*wait=*/true);
}

FullyShardedState::GatheredGuard::~GatheredGuard() {
  if (!s_) return;
  for (auto& u : s_->units_) s_->reshard(*u);
}

int64_t FullyShardedState::owned_bytes() const {
  int64_t n = pool_->held_bytes();
  for (auto* f : all_flats_) n += f->owned_bytes();
  return n;
}

void FullyShardedState::note_memory() { peak_owned_bytes_ = std::max(peak_owned_bytes_, owned_bytes()); }

}  // namespace dtrain::fsdp
