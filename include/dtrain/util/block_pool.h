#pragma once
// A pool of free memory blocks by size, for the library's own buffers: the CPU counterpart of the
// CUDA caching allocator PyTorch's FSDP and ZeRO rely on.
//
// Design note [buffers reused]
// ----------------------------
// Every step FSDP needs, per unit, a full buffer for each gather, a flat gradient buffer, a
// reduce-scatter output (a shard) and, on Gloo, the all-gather's and the reduce-scatter's
// workspaces (a unit each: comm/all_gather.h, comm/reduce_scatter.h), plus a cast shard to send
// under mixed precision. On the CPU a multi-megabyte block returned to the system comes back at
// its next use as fresh pages (a page fault and a zero-fill per 4 KiB, several times per step),
// and one malloc keeps is memory the process holds anyway. So all of them come from a pool
// (pooled_empty) and go back to it (give_back) when their use ends. On the CPU the pool keeps
// every block it is given (`keep_per_size` unbounded): after the first step it holds, per size,
// the most blocks that were in use at once, which the schedule bounds (max_gathered_units and the
// reductions in flight, Design note [backward memory], fsdp/fully_sharded_data_parallel.h), and a
// steady-state step allocates no buffer of FSDP's (tests/fsdp/buffers_test.cpp counts them: none
// of 1 MiB or more). The price: the buffers' peak is the schedule's, as before, but it is held
// through the whole step, the activations' peak included (FullyShardedState::owned_bytes() and
// the memory planner count it; on the demo model FSDP's counted peak grew by about one unit, 5%,
// and is predicted exactly). Under gradient accumulation (no_sync) every unit's gradient buffer
// is in use at once, so the pool then keeps the whole unsharded gradient, which the step held
// anyway (the planner counts it). A buffer whose collective failed is dropped, never given back
// (FlatParam::abandon_gather: the backend may still write it). On a GPU the caching allocator does all this already (and lends
// the memory to activations between uses): there the pool keeps one block per size. Autograd's
// own outputs (activations, each parameter's gradient before it is added to its slot) and the
// optimizer's temporaries are libtorch's, not pooled.
//
// The quantized collectives FSDP runs take their packed buffers from its pool too
// (comm::QuantizedOptions::pool; their fp32 temporaries are a slice's, under 1 MiB). DDP's buckets
// are made once with its reducer, and the bf16/fp16 hook keeps each bucket's narrow buffers from
// its first step (ddp::NarrowBuffers) (tests/ddp/buffers_test.cpp: none allocated in a steady step). ZeRO's are not pooled, by measurement: ZeRO-2's flat bucket and its reduce-
// scatter's workspace exist at the end of backward only, after the activations are freed, and
// ZeRO-1's broadcast buffer (the largest owner's parameters) in the optimizer step only; held
// through the step they cost the memory ZeRO exists to save: the demo's counted peak at W = 2 grew
// from 56 to 80 MiB under zero2 (pooled like FSDP's, buckets sharing the largest's size) and from
// 44 to 50 MiB under zero1 (tests/examples/memory_plan_test.cpp, 2026-11-29).
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include <c10/core/Allocator.h>

#include <ATen/core/Tensor.h>

namespace dtrain::util {

class BlockPool {
 public:
  explicit BlockPool(size_t keep_per_size) : keep_(keep_per_size) {}
  at::DataPtr take(size_t nbytes, c10::Allocator* allocator);
  void give(at::DataPtr block, size_t nbytes);
  int64_t held_bytes() const;

 private:
  size_t keep_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<at::DataPtr>> free_;
  int64_t held_ = 0;
};

// A flat tensor of `numel` elements whose storage comes from `pool` (when given): fixed-size, not
// resizable, like any buffer a collective writes. Give it back with give_back().
at::Tensor pooled_empty(int64_t numel, const at::TensorOptions& options, BlockPool* pool);
// Returns `t`'s storage to `pool` (or frees it without one) and leaves the storage empty, whatever
// else still refers to it (Design note [freeing gathered parameters], fsdp/flat_param.h).
void give_back(const at::Tensor& t, BlockPool* pool);

}  // namespace dtrain::util
