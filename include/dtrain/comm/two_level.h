#pragma once
// An all-reduce in two levels where a group spans nodes: inside each node first, across nodes once
// (Horovod's hierarchical all-reduce; NCCL does the like inside its own rings). DDP and ZeRO-1's
// gradient buckets under --hierarchical-all-reduce (ddp/distributed_data_parallel.h).
//
// Design note [two-level all-reduce]
// ----------------------------------
// A flat ring over W ranks on n nodes of L ranks (laid out node by node) crosses each node's link
// once each way and sends 2 (W - 1) / W of the tensor B over it: about 2B whatever the nodes. In
// two levels the tensor is reduce-scattered inside the node (each of the L ranks ends with the
// node's sum of one part of B / L), each part all-reduced across the nodes among the ranks of that
// local index (n ranks: 2 (n - 1) / n of B / L each, L of them side by side on the node's link),
// and all-gathered back inside the node: the node's link carries 2 (n - 1) / n x B, 2 (W - 1) / W
// / (2 (n - 1) / n) times less than the ring's: 1.5x at 2 x 2, 1.75x at 2 x 4, 2x for many ranks
// on two nodes. The sum runs in another order than the ring's (equal to a tolerance, not to the
// bit: every rank gets the same bytes). Where the group is not split in two levels
// (comm::split_by_node: one node, one rank a node, uneven nodes) it is the flat all_reduce.
//   - The first level is launched at once (overlapping what the caller does next); the across and
//     gather levels are the work's next stages (comm::Work::staged): each starts when the caller
//     advances the work, the rest when it waits. DDP's reducer advances the bucket before each
//     bucket it launches, so a bucket's across level runs over the slow link while backward
//     computes the next buckets' gradients (the same points on every rank: bucket order), and the
//     last buckets' when the reducer waits.
//   - In place: this rank's part of the node's sum lands in its own slot of the tensor (the
//     reduce-scatter's output a view of its input: the rows are summed from what was received), is
//     all-reduced there across nodes and all-gathered from there. On Gloo the reduce-scatter and
//     the all-gather are all-to-alls that need a workspace of the tensor's size (comm/reduce_scatter.h,
//     comm/all_gather.h): the caller's, kept from step to step (DDP keeps one per bucket: Design note
//     [buffers reused]), or one allocated per call. A tensor whose size L does not divide goes
//     through a padded copy.
#include <ATen/core/Tensor.h>

#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

// `tensor` (contiguous) becomes the sum (or mean: options.op Avg) over pg's ranks, in two levels
// where `nodes` (split_by_node(pg)) has them; Sum and Avg only there. `workspace` (may be
// undefined): two_level_workspace_numel elements of the tensor's dtype and device, used where
// two_level_uses_workspace; it must live until the work ends.
Work two_level_all_reduce(const ProcessGroup& pg, const NodeGroups& nodes, at::Tensor& tensor,
                          const AllReduceOptions& options = {}, const at::Tensor& workspace = {});
bool two_level_uses_workspace(const NodeGroups& nodes);
int64_t two_level_workspace_numel(const NodeGroups& nodes, int64_t numel);  // L x ceil(numel / L)

}  // namespace dtrain::comm
