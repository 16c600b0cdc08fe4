#pragma once
// FSDP's collectives, stateless (as FSDP2's _fsdp_collectives.py): what goes over the network for
// one FlatParam, given the buffers. Who owns the buffers and when they are freed is FlatParam's
// business (flat_param.cpp); when each runs is the schedule's (iteration.cpp). Not installed.
#include <ATen/core/Tensor.h>

#include "dtrain/comm/work.h"
#include "dtrain/fsdp/layout.h"
#include "dtrain/fsdp/quantization.h"

namespace dtrain::util {
class BlockPool;  // (util/block_pool.h)
}  // namespace dtrain::util

namespace dtrain::fsdp::collectives {

// All-gather of `send` (this rank's shard, already in `full`'s dtype and device) over the shard
// group into `full` (S x send.numel()); `workspace` (may be undefined) as comm::AllGatherOptions
// says. With one shard it is a copy and the returned work is empty. `send` and `workspace` must
// live until the work ends. quant.gathers(): block-quantized (comm::quantized_all_gather; no
// workspace: its packed buffers from `pool`, Design note [buffers reused], util/block_pool.h).
comm::Work all_gather_shard(const ShardGroups& groups, const at::Tensor& send, at::Tensor& full,
                            const at::Tensor& workspace, const Quantization& quant, util::BlockPool* pool = nullptr);

// The backward's gather from node copies (Design note [secondary shards], secondary_shard.h): an
// exact all-gather of `part` (this rank's node copy) over groups.shard_nodes.within into `full`
// (L x part.numel()); `workspace` as above.
comm::Work all_gather_node_copy(const ShardGroups& groups, const at::Tensor& part, at::Tensor& full,
                                const at::Tensor& workspace);

// Reduce-scatter of a flat gradient (S x chunk) over the shard group into `grad_shard` (chunk,
// given by the caller), averaged over the world, asynchronously; `workspace` (may be undefined)
// is where a backend without a native reduce-scatter receives the parts (comm/reduce_scatter.h).
// With one shard (NoShard), `grad_shard` becomes `grad_flat` and the only collective is the
// all-reduce across replicas (empty work with no replicas). quant.reductions(): the
// reduce-scatter block-quantized (comm::quantized_reduce_scatter, in two levels where
// groups.shard_nodes has them; no workspace), and with one shard the all-reduce
// (comm::quantized_all_reduce), their buffers from `pool`.
comm::Work reduce_scatter_grad(const ShardGroups& groups, const at::Tensor& grad_flat, at::Tensor& grad_shard,
                               const at::Tensor& workspace, const Quantization& quant, util::BlockPool* pool = nullptr);

// After reduce_scatter_grad's work ended: HSDP's average across the replicate group (none when there
// are no replicas, or with one shard, where reduce_scatter_grad did it); quant.reductions():
// block-quantized (comm::quantized_all_reduce).
void all_reduce_replicas(const ShardGroups& groups, at::Tensor& grad_shard, const Quantization& quant,
                         util::BlockPool* pool = nullptr);

}  // namespace dtrain::fsdp::collectives
