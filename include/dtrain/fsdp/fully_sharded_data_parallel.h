#pragma once
// FullyShardedDataParallel (FSDP, ZeRO-3) for libtorch modules, with hybrid sharding (HSDP), after
// FairScale's FSDP pull request and PyTorch's FSDP/FSDP2, on Gloo (CPU) and NCCL (CUDA).
//
//   using namespace dtrain;
//   models::GPT gpt(models::GPTOptions().layers(12));
//   auto model = fsdp::FullyShardedDataParallel<models::GPT>(gpt, pg,
//       fsdp::FullyShardedOptions().wrap_policy(fsdp::WrapPolicy::by_type<models::GPTBlockImpl>()));
//   torch::optim::AdamW opt(model->parameters(), 1e-3);   // the local fp32 shards, any optimizer
//   auto loss = models::gpt_loss(model->forward(x), y);   // the wrapper owns the root's forward
//   loss.backward();       // gradients reduce-scattered unit by unit: each rank keeps its shard
//   model->clip_grad_norm(1.0);                           // optional: global norm over shards
//   opt.step();
//
// Units (wrap.h, unit.h): the root and every module the wrap policy picks. Each unit's parameters
// live as one flat master shard per rank (flat_param.h). Per iteration, per unit:
//   forward:  gather (all-gather) -> run -> free (FullShard; kept until backward for ShardGradOp)
//   backward: the first gradient at its outputs gathers again -> autograd runs its backward ->
//             when every parameter's gradient has arrived, one reduce-scatter (+ an all-reduce
//             across replicas for HybridShard/NoShard) adds the average to the shard's .grad,
//             the full gradients are dropped and the parameters freed.
// The root's parameters stay gathered from its forward to the end of its backward. Nested units
// are entered through forward hooks (Design note [forward hooks]): a picked module must be a
// dtrain::nn::Hookable. Prefetch: in forward the next unit (in the previous iteration's order) and
// in backward the next unit (reverse forward order) start their all-gather early, with at most
// max_gathered_units nested units gathered at once; backward_prefetch and overlap_reduction choose
// how much of backward's communication overlaps computation, and so how many units' parameters and
// gradients a rank holds at once (Design note [backward memory]).
//
// Parameters of the wrapped module are the module's own tensors throughout (Design note [freeing
// gathered parameters]); outside a unit's forward/backward they are empty placeholders, so read
// weights through full_state_dict() or gather_full_params(). Tied parameters go to the innermost
// unit enclosing all their uses; frozen parameters (requires_grad false) get FlatParams of their
// own that are gathered but never reduced; buffers are not sharded (broadcast from rank 0 at
// construction when sync_module_states, cast to buffer_dtype).
//
// Gradient accumulation: under no_sync() backward reduces nothing (full gradients accumulate in
// the module's parameters, as PyTorch's FSDP); without it, each backward's average is added to the
// shards' .grad. Every rank must run the same units in the same order (same model, same control
// flow); a parameter with no gradient in a synchronized backward counts as a zero gradient.
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/nn/wrapper.h"
#include "dtrain/util/no_sync_guard.h"
#include "dtrain/fsdp/layout.h"
#include "dtrain/fsdp/mixed_precision.h"
#include "dtrain/fsdp/quantization.h"
#include "dtrain/fsdp/secondary_shard.h"
#include "dtrain/fsdp/unit.h"
#include "dtrain/fsdp/wrap.h"

namespace dtrain::fsdp {

// When a unit's backward starts the all-gather of the unit that runs next in backward (after
// PyTorch's BackwardPrefetch). Memory counts one block-sized unit k with P_k parameters, 4 B each
// in fp32, beyond the shards and the root; see Design note [backward memory].
enum class BackwardPrefetch {
  None,            // no prefetch: a unit gathers its parameters when its backward starts (the gather
                   // overlaps nothing but the previous unit's reduction)
  BeforeBackward,  // BACKWARD_PRE: at a unit's pre-backward, before its gradients are computed: the
                   // gather overlaps the unit's backward; a rank holds two units' parameters
  AfterBackward,   // BACKWARD_POST: at a unit's post-backward, after its full parameters are freed:
                   // the gather overlaps the unit's reduction, never computation; one unit's
                   // parameters at a time (the root prefetches at its pre-backward: it stays
                   // gathered through the whole backward)
};
const char* to_string(BackwardPrefetch p);
// "none" | "before" | "after" (the demo's --backward-prefetch values); throws naming the value.
BackwardPrefetch parse_backward_prefetch(const std::string& name);

// Initialises one parameter in place: (name in the unwrapped module, a full fp32 tensor of its
// shape). Called once per parameter, in the model's named_parameters() order.
using ParamInitFn = std::function<void(const std::string& name, at::Tensor& param)>;
// Elements [begin, end) of a named tensor, flattened (checkpoint::Reader::read has this shape).
using RangeReader = std::function<at::Tensor(const std::string& key, int64_t begin, int64_t end)>;

struct FullyShardedOptions {
  TORCH_ARG(ShardingStrategy, sharding) = ShardingStrategy::FullShard;
  // HybridShard only: {replicate, shard}; shard 0 means ranks per node (LOCAL_WORLD_SIZE).
  TORCH_ARG(MeshLayout, hybrid_layout) = (MeshLayout{0, 0});
  TORCH_ARG(WrapPolicy, wrap_policy) = WrapPolicy::none();
  TORCH_ARG(MixedPrecision, mixed_precision) = {};
  // Prefetch the next unit's all-gather in forward; in backward, see BackwardPrefetch.
  TORCH_ARG(bool, forward_prefetch) = true;
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::BeforeBackward;
  // true: a unit's gradient reduction (reduce-scatter, or NoShard's all-reduce) runs while the next
  // unit's backward computes, so its flat gradient buffer lives on meanwhile (at most one unit's
  // reduction in flight). false: it is finished before the next unit's gradient buffer is
  // allocated, which then reuses its block (BlockPool): one unit's gradients at a time.
  TORCH_ARG(bool, overlap_reduction) = true;
  // Bound on nested units whose parameters are gathered at once by prefetching (a unit that runs
  // is always gathered); as limit_all_gathers, it caps peak memory.
  TORCH_ARG(int, max_gathered_units) = 2;
  // Broadcast parameters and buffers from rank 0 before sharding (every rank built the model).
  // Ignored with param_init_fn.
  TORCH_ARG(bool, sync_module_states) = true;
  // The large-model path: the module was built with placeholder parameters (e.g.
  // GPTOptions::defer_init); each parameter is materialised alone, initialised by this function
  // and sharded before the next, so no rank ever holds more than one full parameter beyond its
  // shards. Deterministic for a seeded function: every rank computes the same values.
  TORCH_ARG(ParamInitFn, param_init_fn) = nullptr;
  // For CUDA runs: keep the master shards, their gradients and the optimizer state on the CPU
  // (the optimizer steps there); each gather copies a shard to the GPU, each reduced gradient
  // shard comes back. A no-op for a model on the CPU. Not yet run on a GPU.
  TORCH_ARG(bool, cpu_offload) = false;
  // Parameters gathered and/or gradients reduce-scattered block-quantized as int8
  // (fsdp/quantization.h, Design note [block quantization], comm/quantized.h).
  TORCH_ARG(Quantization, quantization) = {};
  // Node: the backward's gathers inside the node, from a copy kept after the forward (hpZ; Design
  // note [secondary shards], fsdp/secondary_shard.h).
  TORCH_ARG(SecondaryShard, secondary_shard) = SecondaryShard::None;
  // Design note [freed memory]: FSDP frees a unit's gathered parameters and gradient buffers after
  // each use. glibc's malloc serves blocks of 128 KiB and more by mmap and returns them to the
  // system when freed, but raises that threshold to the size of each mmapped block freed (up to
  // 32 MiB), after which such blocks come from the heap and their memory stays with the process:
  // the full model built before FSDP shards it and every gathered unit then stay resident (peak
  // RSS per rank 0.9-1.0x DDP's at W=4 although FSDP holds a quarter of the state). So the
  // constructor fixes the threshold (mallopt M_MMAP_THRESHOLD, which also ends the raising) unless
  // MALLOC_MMAP_THRESHOLD_ is set in the environment: at this many bytes; or, with -1 (the
  // default), at 1 MiB where some unit's gathered parameters reach 8 MiB (where retained buffers
  // cost real memory) and not at all for smaller models; 0 leaves malloc alone. Process-wide:
  // every later allocation of that size or more is mmapped and unmapped when freed, so each costs
  // page faults: 128 KiB made the demo model's FSDP step 1.8x slower, 1 MiB about 1.15x (its 2 MiB
  // MLP activations), hence nothing for small models. On the 25.5M-parameter model (units of
  // 12.6 MiB) 1 MiB gives the peak of 128 KiB (bench/README.md#fsdp). Since FSDP's own buffers
  // stay in its pool (Design note [buffers reused], util/block_pool.h) the threshold no longer
  // costs that model speed (134 tokens/s with it, 130 without) and still saves memory (509 against
  // 597 MiB per rank at W = 2 on glibc; docs/benchmarks.md).
  TORCH_ARG(int64_t, malloc_mmap_threshold) = -1;
};

// A piece of this rank's shard: elements [begin, begin + count) of parameter `name`, stored at
// `shard_offset` in trainable (or frozen) flat shard `flat` (an index into shards()).
struct ShardSlice {
  std::string name;
  std::vector<int64_t> shape;
  int64_t begin = 0;
  int64_t count = 0;
  size_t flat = 0;
  int64_t shard_offset = 0;
};

// The non-template part of the wrapper.
class FullyShardedState {
 public:
  // Over `pg`, laid out by options.sharding() (and hybrid_layout() for HybridShard).
  FullyShardedState(std::shared_ptr<torch::nn::Module> module, comm::ProcessGroup pg, FullyShardedOptions options = {});
  // Over groups made once from a parallel layout (train::parallelize): options.sharding() must go
  // with it (NoShard: shard 1; FullShard/ShardGradOp: replicate 1; HybridShard: any).
  FullyShardedState(std::shared_ptr<torch::nn::Module> module, parallel::Groups groups, FullyShardedOptions options = {});
  ~FullyShardedState();
  FullyShardedState(const FullyShardedState&) = delete;
  FullyShardedState& operator=(const FullyShardedState&) = delete;

  // The wrapper's side (Design note [one wrapper template]): it registers the trainable shards as
  // its parameters (the module is deliberately not a registered child: its own parameters are
  // views that come and go).
  void attach(torch::nn::Module& wrapper);
  void before_forward();
  void after_forward(const std::vector<at::Tensor>& outs);
  // A single-tensor output in mixed_precision().output_dtype() (other outputs are left as they are).
  at::Tensor finish_output(at::Tensor out);

  // Every rank's master shards, in unit order: what the optimizer steps (trainable only) and what
  // a sharded checkpoint holds.
  std::vector<at::Tensor> trainable_shards() const;
  std::vector<at::Tensor> shards() const;  // trainable and frozen, same order as ShardSlice::flat
  std::vector<ShardSlice> slices() const;
  // Every parameter name of the unwrapped module (tied aliases too) with its full shape and master
  // dtype, in named_parameters() order; and its buffers.
  struct ParamInfo {
    std::string name;
    std::vector<int64_t> shape;
    at::ScalarType dtype;
  };
  std::vector<ParamInfo> parameter_infos() const;
  const std::vector<std::pair<std::string, at::Tensor>>& buffers() const { return buffers_; }

  // Collective over the shard group: global gradient norm over every shard (HSDP replicas hold
  // equal shards and are not counted twice); scales the shards' gradients when above max_norm.
  double clip_grad_norm(double max_norm, double norm_type = 2.0);

  // Full state dict, keys and shapes of the unwrapped module (parameters, tied aliases, buffers),
  // fp32 masters: gathered one unit at a time; only `rank` (of the data-parallel group: the world
  // unless tensor parallel) keeps the values (others get an empty dict). Collective.
  torch::OrderedDict<std::string, at::Tensor> full_state_dict(int rank = 0);
  // Loads a full state dict (every rank passes it; checked against the module's names and shapes).
  void load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict);
  // This rank's part of every parameter as checkpoint pieces ("<prefix><name>"), no communication;
  // with replicas (HybridShard, NoShard) only the first replica's ranks write parameters, so every
  // element is written once; buffers are split among the world ranks as replicated state.
  std::vector<checkpoint::Piece> sharded_state_dict(const std::string& prefix = "model/") const;
  // Loads the ranges this rank holds from any layout (any world size or strategy that saved
  // "<prefix><name>" keys), e.g. checkpoint::Reader::read.
  void load_sharded_state_dict(const RangeReader& read, const std::string& prefix = "model/");

  // Plain full weights for inference: one safetensors file at `path` (checkpoint::StreamingWriter,
  // atomic), written by `rank` one FlatParam at a time as it is gathered, so that rank never holds
  // more than one unit beyond its shards. Each parameter once (under its first name; tied aliases
  // are left out, as safetensors files do), in the master dtype (or `dtype`), then the buffers.
  // Collective; returns the file's path on `rank`, "" elsewhere.
  std::string export_full_weights(const std::string& path, int rank = 0,
                                  std::optional<at::ScalarType> dtype = std::nullopt);

  // Gathers every unit (e.g. to evaluate or print the whole model); frees them when it dies.
  class GatheredGuard {
   public:
    explicit GatheredGuard(FullyShardedState* s);
    GatheredGuard(GatheredGuard&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
    GatheredGuard(const GatheredGuard&) = delete;
    GatheredGuard& operator=(const GatheredGuard&) = delete;
    ~GatheredGuard();

   private:
    FullyShardedState* s_;
  };
  GatheredGuard gather_full_params() { return GatheredGuard(this); }

  using NoSyncGuard = util::NoSyncGuard;
  NoSyncGuard no_sync() { return NoSyncGuard(&sync_); }

  const ShardGroups& groups() const { return groups_; }
  const FullyShardedOptions& options() const { return options_; }
  const std::vector<std::unique_ptr<Unit>>& units() const { return units_; }
  // Bytes this rank owns now: master shards, their gradients, gathered parameters and gradients,
  // collective buffers, and the free blocks the pool keeps for the next step (for memory reports;
  // optimizer state is the optimizer's).
  int64_t owned_bytes() const;
  // Of those, the pool's free blocks (Design note [buffers reused], util/block_pool.h).
  int64_t pooled_bytes() const;
  int64_t peak_owned_bytes() const { return peak_owned_bytes_; }
  void reset_peak() { peak_owned_bytes_ = owned_bytes(); }
  // Gives the wrapped module its parameters back as plain full-shape tensors (zeros: load the
  // values after) and removes this state's hooks, so the module can be wrapped again, on another
  // group (in-process recovery: Design note [sharded state in process], train/recovery.h). Local,
  // in any state (an aborted step's too); the shards and their optimizer state stay readable
  // (snapshots), nothing else of this state is used after.
  void release_module();
  // Collectives issued so far (FlatParam gathers and reductions), e.g. to check that activation
  // checkpointing adds no all-gather.
  struct Stats {
    int64_t all_gathers = 0;
    int64_t reduce_scatters = 0;
  };
  const Stats& stats() const { return stats_; }
  std::string describe() const;

 private:
  // The per-iteration phase (Unit::State holds each unit's part).
  enum class Phase {
    Idle,      // between iterations
    Forward,   // the root's forward is running (or returned and no backward started yet)
    Backward,  // a backward of this iteration is running; ends in end_of_backward()
  };
  void build_units(const std::vector<std::pair<std::string, at::Tensor>>& named_params);
  void materialize(const std::vector<std::pair<std::string, at::Tensor>>& named_params);
  void install_hooks();
  void pre_forward(Unit& u);
  void post_forward(Unit& u, const std::vector<at::Tensor>& outputs);
  void pre_backward(Unit& u);
  void on_grad_ready(Unit& u);
  void post_backward(Unit& u);
  void end_of_backward();
  void finish_leftover_iteration();
  void gather(Unit& u, bool wait);
  void count_gathers(int started);  // FlatParam all-gathers a unit started (Stats)
  void prefetch(const std::vector<int>& order, int after);
  void prefetch_backward(const Unit& u);       // the unit that runs after `u` in backward
  void finish_reductions(const Unit* except);  // waits for every reduction in flight but except's
  void start_backward_round();
  int gathered_nested_units() const;
  at::Tensor gather_master(const FlatParam& f) const;  // all of `f`, master dtype (collective)
  void note_memory();

  std::shared_ptr<torch::nn::Module> module_;
  FullyShardedOptions options_;
  ShardGroups groups_;
  std::unique_ptr<BlockPool> pool_;           // before units_: FlatParams return blocks to it
  std::vector<std::unique_ptr<Unit>> units_;   // [0] is the root
  std::vector<std::pair<std::string, at::Tensor>> buffers_;
  struct NamedParam {
    std::string name;  // every name of the unwrapped module's named_parameters(), aliases too
    FlatParam* flat;
    size_t entry;
  };
  std::vector<NamedParam> named_;
  std::vector<FlatParam*> all_flats_;  // unit order
  std::vector<at::Tensor> originals_;  // construction only: the parameters' initial values
  std::vector<int> forward_order_, last_forward_order_;
  Phase phase_ = Phase::Idle;
  bool sync_ = true;
  bool synced_iteration_ = true;  // sync_ when the iteration's forward started
  std::mutex mu_;
  int64_t peak_owned_bytes_ = 0;
  Stats stats_;
};

// FullyShardedDataParallel<M>(module, pg, options = {}): the one wrapper template (Design note
// [one wrapper template]) with FSDP's own calls added.
template <class ModuleHolder>
class FullyShardedDataParallelImpl : public nn::WrapperImpl<ModuleHolder, FullyShardedState> {
 public:
  using nn::WrapperImpl<ModuleHolder, FullyShardedState>::WrapperImpl;
  using nn::WrapperImpl<ModuleHolder, FullyShardedState>::state;

  double clip_grad_norm(double max_norm, double norm_type = 2.0) { return state().clip_grad_norm(max_norm, norm_type); }
  torch::OrderedDict<std::string, at::Tensor> full_state_dict(int rank = 0) { return state().full_state_dict(rank); }
  void load_full_state_dict(const torch::OrderedDict<std::string, at::Tensor>& d) { state().load_full_state_dict(d); }
  FullyShardedState::GatheredGuard gather_full_params() { return state().gather_full_params(); }
};

template <class ModuleHolder>
using FullyShardedDataParallel =
    nn::Wrapper<ModuleHolder, FullyShardedState, FullyShardedDataParallelImpl<ModuleHolder>>;

}  // namespace dtrain::fsdp
