#pragma once
// FlatParam: the unit of communication of FSDP. The parameters of one unit (of one dtype, all
// trainable or all frozen) are laid end to end in one flat vector, padded to a multiple of the
// shard-group size S, and rank s keeps elements [s*chunk, (s+1)*chunk) as its master shard (the
// tensor the optimizer steps). Gathering is one all-gather into a persistent full buffer whose
// storage is allocated before and released after (Design note [freeing gathered parameters]);
// gradients leave through one reduce-scatter (then one all-reduce across replicas for HSDP).
//
// Design note [freeing gathered parameters]
// -----------------------------------------
// The module's own parameter tensors stay the module's (libtorch modules keep them as members,
// e.g. Linear::weight, so they cannot be replaced); FSDP changes only what they point at, with
// set_data: a view of the full buffer while gathered, an empty placeholder while sharded (a use in
// that state fails on a shape check instead of reading freed memory). Autograd saves parameters and
// views of them (w.t()) for backward; those views keep the full buffer's *storage* object, so
// freeing by swapping tensors would free nothing. Instead the storage itself is resized to zero
// bytes when resharding and back to full size when gathering (as PyTorch's FSDP free_storage /
// alloc_storage): every saved view sees the re-gathered values in backward, and the bytes are
// really returned in between. Parameters stay autograd leaves, so their gradients accumulate in
// their own .grad (compute dtype, full shape) and gradient-accumulator hooks (Design note
// [backward hooks]) say when a unit's gradients are complete.
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <c10/core/Allocator.h>

#include <ATen/core/Tensor.h>

#include "dtrain/comm/work.h"
#include "dtrain/fsdp/layout.h"
#include "dtrain/fsdp/quantization.h"
#include "dtrain/fsdp/secondary_shard.h"
#include "dtrain/util/block_pool.h"

namespace dtrain::fsdp {

using util::BlockPool;  // (Design note [buffers reused], util/block_pool.h)
using util::pooled_empty;

class FlatParam {
 public:
  enum class State {
    Sharded,    // only the master shard exists; module parameters are empty placeholders
    NodeSharded,  // as Sharded, and this rank's part of the node's copy of the gathered values is
                  // kept for the backward's gather (Design note [secondary shards], secondary_shard.h)
    Gathering,  // all-gather into the full buffer in flight; parameters not usable yet
    Gathered,   // full buffer valid; module parameters are views of it
  };
  struct Entry {
    std::string name;            // name in the unwrapped module (first name, for tied parameters)
    at::Tensor param;            // the module's parameter tensor (identity kept)
    std::vector<int64_t> shape;  // its full shape
    int64_t offset = 0;          // in the flat vector
    int64_t numel = 0;
  };

  // `params`: distinct module parameters of one dtype, all requiring grad or none. Their values
  // are not read here: set them with load() (FSDP does, in the model's parameter order).
  // `compute_dtype`: dtype of the gathered parameters; `reduce_dtype`: of gradient reduction.
  // `pool` (optional, must outlive this) recycles full and gradient buffers. `cpu_offload`: the
  // master shard (so its gradient and the optimizer state) lives on the CPU; gathering copies it
  // to the parameters' device, and the reduced gradient comes back to the CPU. `quant`: what
  // travels block-quantized (fsdp/quantization.h). `secondary`: Node keeps a node copy when
  // resharding for a backward (where groups.shard_nodes is two-level).
  FlatParam(std::vector<at::Tensor> params, std::vector<std::string> names, const ShardGroups& groups,
            at::ScalarType compute_dtype, at::ScalarType reduce_dtype, std::string unit_name,
            BlockPool* pool = nullptr, bool cpu_offload = false, Quantization quant = {},
            SecondaryShard secondary = SecondaryShard::None);
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  // --- values ---
  // Copies this rank's part of entry `i`'s full value (any dtype/layout, entries()[i].shape).
  void load(size_t i, const at::Tensor& full_value);
  // This rank's part of entry i: [begin, end) of the parameter's flattened elements (begin == end
  // when this rank holds none of it), and the matching slice of the master shard.
  std::pair<int64_t, int64_t> local_range(size_t i) const;
  at::Tensor local_part(size_t i) const;  // a view of the master shard (no copy)

  // --- parameters ---
  // Sharded -> Gathering (Gathered at once when nothing to communicate); NodeSharded -> Gathering
  // inside the node, from the node copy.
  void gather_async();
  void wait_gather();   // Gathering -> Gathered; binds the module parameters
  void gather() {
    gather_async();
    wait_gather();
  }
  // Gathered -> Sharded (a no-op for a full buffer aliasing the shard); with `for_backward`,
  // -> NodeSharded where a secondary shard applies. NodeSharded -> Sharded (the copy dropped)
  // unless `for_backward`.
  void reshard(bool for_backward = false);
  State state() const { return state_; }
  // Makes the module parameters full-shape stand-ins (stride-0, one element) so gradient
  // accumulators can be created with the right metadata while sharded.
  void bind_stand_ins();
  // Back to empty placeholders (after bind_stand_ins; Sharded state only).
  void bind_placeholders();
  // Gives the module its parameters back: each bound to zeros of its full shape and the master
  // dtype, no gradient. In any state, no collective; this FlatParam is not used after (the module
  // is about to be wrapped again: Design note [sharded state in process], train/recovery.h).
  void release();

  // --- gradients ---
  // Before the unit's backward: gives each parameter a .grad that is its slot in one flat
  // gradient buffer (zeroed), so autograd accumulates in place and the reduce-scatter reads the
  // buffer without a copy (as DDP's gradient_as_bucket_view). Skipped when gradients are reduced
  // in another dtype than they are computed in (then reduce_grads_async copies).
  void bind_grad_slots();
  // Copies the parameters' .grad (zeros where undefined) into a flat buffer, drops them, and
  // launches the reduce-scatter (averaging over the world).
  void reduce_grads_async();
  // Waits for it, all-reduces across replicas (HSDP), adds the result to shard().grad.
  void finish_reduce();
  bool reducing() const { return reducing_; }

  at::Tensor& shard() { return shard_; }  // master shard: [chunk], a leaf (requires grad if trainable)
  const at::Tensor& shard() const { return shard_; }
  const std::vector<Entry>& entries() const { return entries_; }
  bool trainable() const { return trainable_; }
  int64_t numel() const { return numel_; }  // unpadded
  int64_t chunk() const { return chunk_; }
  int64_t shard_begin() const { return chunk_ * shard_rank_; }
  int64_t full_bytes() const;  // the gathered buffer's size
  // Bytes this FlatParam holds now: master shard and its gradient, the full buffer while
  // allocated (unless it is the shard), the flat gradient buffer and reduced shard while they
  // exist, and parameter gradients not bound to slots of that buffer.
  int64_t owned_bytes() const;
  const std::string& unit_name() const { return unit_name_; }

 private:
  void bind_views();
  at::Tensor new_grad_buffer();
  void accumulate_reduced();
  void abandon_gather();
  void abandon_reduction();
  bool keeps_node_copy() const;
  void drop_node_copy();

  std::string unit_name_;
  const ShardGroups* groups_;
  BlockPool* pool_;
  Quantization quant_;
  SecondaryShard secondary_;
  std::vector<Entry> entries_;
  bool trainable_ = false;
  at::ScalarType master_dtype_, compute_dtype_, reduce_dtype_;
  at::Device device_ = at::kCPU;  // of the module's parameters (gathered buffers, reductions)
  int64_t numel_ = 0, chunk_ = 0;
  int shard_rank_ = 0, shard_size_ = 1;
  bool aliased_ = false;  // one shard, same dtype: the full buffer IS the master shard
  at::Tensor shard_;      // master
  at::Tensor full_;       // compute dtype, chunk * S; storage released while Sharded
  at::Tensor send_;       // the shard in compute dtype while an all-gather is in flight
  bool send_pooled_ = false;  // send_ is a cast copy or the node copy, from the pool (else the shard itself)
  at::Tensor node_copy_;      // NodeSharded: full_'s part at this rank's index in its node (from the pool)
  at::Tensor gather_workspace_;  // (Gloo: the all-gather's input copies, from the pool)
  comm::Work gather_work_;
  at::Tensor grad_flat_, grad_shard_, workspace_;  // (all from the pool while a reduction is in flight)
  comm::Work reduce_work_;
  bool reducing_ = false;
  State state_ = State::Sharded;
};

// Storage management of Design note [freeing gathered parameters] (through `pool` when given); the
// storage is freed with util::give_back.
void alloc_storage(const at::Tensor& t, size_t nbytes, BlockPool* pool = nullptr);

}  // namespace dtrain::fsdp
