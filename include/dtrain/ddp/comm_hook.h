#pragma once
// Communication hooks: how a data-parallel gradient bucket is reduced (PyTorch's DDP comm hooks).
//
// Design note [gradient compression]
// ----------------------------------
// Between machines, data parallelism is bound by the link; a hook trades precision for bytes.
//  - The hook owns one bucket's reduction: given this rank's flat gradients it starts the
//    reduction and returns a comm::Work; once that is done the bucket holds the MEAN over the
//    ranks (as PyTorch's hooks: the reducer divides nothing after a hook). The reducer calls it in
//    bucket order, from backward, as it would launch its all-reduce, so a hook's first phase
//    overlaps the rest of backward; later phases run when the reducer waits (comm::Work::after).
//  - bf16 / fp16 (compressed_all_reduce): the bucket divided by W and cast (half of fp32's bytes),
//    then one all-reduce in that dtype where the backend reduces it (NCCL; Gloo for fp16: a ring,
//    each partial sum rounded; at W = 2 the same as one rounding of the exact sum); where it cannot
//    (bf16 on libtorch 1.13's Gloo) reduce-scattered with the sum in fp32 (an all-to-all of the parts
//    and a local sum) and all-gathered in bf16: one rounding per input and one of the sum. Gloo's
//    all-to-all moves bytes at about half a limited link's rate (measured: docs/ddp.md), so the
//    one all-reduce comes first. ZeRO-2 reduce-scatters the same way (compressed_reduce_scatter).
//  - Two levels (--hierarchical-all-reduce, Design note [two-level all-reduce], comm/two_level.h)
//    with bf16 / fp16 (compressed_two_level_all_reduce): each rank's bucket divided by the node's L
//    ranks and cast, reduce-scattered inside the node with the sum in fp32 (rounded once), each
//    part's mean over the n nodes taken across as compressed_all_reduce does (in the narrow dtype),
//    all-gathered inside the node in the narrow dtype: a node's link carries 2 (n - 1) / n of the
//    bucket in 16 bits, against the flat fp32 ring's 2 (W - 1) / W in 32 (3x fewer at 2 x 2). The
//    reducer offers the hook its node split (CommHook::use_nodes); the cast hook takes it.
//  - PowerSGD (ddp/powersgd.h): a rank-R approximation of each matrix-shaped gradient with error
//    feedback, as PyTorch's powerSGD_hook.
//  - A hook's state (PowerSGD's error feedback and warm-started factors) is this rank's: saved in
//    checkpoints under compression/ keys (Strategy's state_snapshot) and loaded at the same world
//    size with every rank's part there; else the state starts over (the error of one step, said once). Under --elastic a
//    membership change starts it over on every rank alike, the warm-up counted from the run's step
//    (train::Strategy::continue_compression_at): members and joiners compress from the same step.
// The strategies that cannot use a setting refuse it in the plan (parallel::Plan::validate).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::ddp {

// One bucket of one backward, as a hook sees it.
struct GradBucket {
  size_t index = 0;                // stable from step to step (the reducer's bucket order)
  at::Tensor buffer;               // flat, this rank's gradients; the hook leaves the mean here
  std::vector<at::Tensor> grads;   // views of `buffer` shaped as the bucket's parameters
  bool last = false;               // the last bucket of this backward
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Starts reducing `bucket` over `pg`; when the returned work is done, bucket.buffer holds the
  // mean over the ranks.
  virtual comm::Work reduce(const comm::ProcessGroup& pg, GradBucket& bucket) = 0;
  // This rank's state a checkpoint carries (name -> tensor; names are the hook's own), and loading
  // it back (only names it gave).
  virtual std::vector<std::pair<std::string, at::Tensor>> state() const { return {}; }
  virtual void load_state(const std::vector<std::pair<std::string, at::Tensor>>& /*state*/) {}
  // Forgets the state (a resume at another world size: the saved errors belong to other ranks).
  virtual void reset_state() {}
  // --hierarchical-all-reduce: the reducer's group `pg` split by node (nodes.two_level() false
  // where it does not split); whether this hook reduces pg's buckets in two levels with it (false:
  // the hook cannot). A hook shared by several wrappers keeps each group's.
  virtual bool use_nodes(const comm::ProcessGroup& /*pg*/, const comm::NodeGroups& /*nodes*/) { return false; }
  // As the command line spells it: "bf16", "fp16", "powersgd:4".
  virtual std::string name() const = 0;
};

// The buffers one bucket's 16-bit reduction uses, kept by a caller that reduces the same bucket
// again (Design note [buffers reused], util/block_pool.h; the cast hook keeps one per bucket): the
// narrow copy, this rank's part, the gathered copy, the collectives' workspaces, the two levels'
// fp32 part and the across level's own. Made at the first call, reused while the sizes hold. nullptr: made per call.
struct NarrowBuffers {
  at::Tensor narrow, part, scatter_work, gathered, gather_work, mean;
  std::shared_ptr<NarrowBuffers> across;
};

// Starts the mean of `tensor` (flat, fp32) over the ranks in `dtype` (bf16 or fp16): the design
// note's two phases. `tensor` holds the mean when the work is done. `buffers`: kept by the caller
// until the work is done and for its next call (nullptr: none kept).
comm::Work compressed_all_reduce(const comm::ProcessGroup& pg, at::Tensor tensor, at::ScalarType dtype,
                                 NarrowBuffers* buffers = nullptr);

// Starts the mean of `tensor` (flat, fp32) over the ranks of `nodes` (split_by_node of the group,
// two_level()) in `dtype`, in two levels: the design note's. `tensor` holds the mean when done.
comm::Work compressed_two_level_all_reduce(const comm::NodeGroups& nodes, at::Tensor tensor, at::ScalarType dtype,
                                           NarrowBuffers* buffers = nullptr);

// Starts the reduce-scatter of the mean of `input` (flat, fp32) with `counts` elements per rank,
// sent in `dtype` (bf16 or fp16); `output` (this rank's part, fp32) holds it when the work is done.
comm::Work compressed_reduce_scatter(const comm::ProcessGroup& pg, at::Tensor output, const at::Tensor& input,
                                     const std::vector<int64_t>& counts, at::ScalarType dtype,
                                     NarrowBuffers* buffers = nullptr);

// The bf16 or fp16 hook (PyTorch's bf16_compress_hook / fp16_compress_hook, with the sum in fp32).
std::shared_ptr<CommHook> cast_hook(at::ScalarType dtype);

}  // namespace dtrain::ddp
