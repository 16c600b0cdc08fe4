#include "collectives.h"

#include <ATen/ATen.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/quantized.h"
#include "dtrain/comm/reduce_scatter.h"

namespace dtrain::fsdp::collectives {

comm::Work all_gather_shard(const ShardGroups& groups, const at::Tensor& send, at::Tensor& full,
                            const at::Tensor& workspace, const Quantization& quant, util::BlockPool* pool) {
  if (groups.shard.size() == 1) {
    full.copy_(send);
    return comm::Work();
  }
  if (quant.gathers()) {
    return comm::quantized_all_gather(
        groups.shard, full, send,
        comm::QuantizedOptions().block(quant.block()).format(quant.gather_format()).async_op(true).pool(pool));
  }
  return comm::all_gather(groups.shard, full, send, comm::AllGatherOptions().workspace(workspace).async_op(true));
}

comm::Work all_gather_node_copy(const ShardGroups& groups, const at::Tensor& part, at::Tensor& full,
                                const at::Tensor& workspace) {
  return comm::all_gather(groups.shard_nodes.within, full, part,
                          comm::AllGatherOptions().workspace(workspace).async_op(true));
}

comm::Work reduce_scatter_grad(const ShardGroups& groups, const at::Tensor& grad_flat, at::Tensor& grad_shard,
                               const at::Tensor& workspace, const Quantization& quant, util::BlockPool* pool) {
  const auto avg = comm::ReduceOp::Avg;
  if (groups.shard.size() == 1) {
    grad_shard = grad_flat;
    if (groups.replicate.size() == 1) return comm::Work();
    if (quant.reductions()) {
      return comm::quantized_all_reduce(groups.replicate, grad_shard,
                                        comm::QuantizedOptions().block(quant.block()).op(avg).async_op(true).pool(pool));
    }
    return comm::all_reduce(groups.replicate, grad_shard, comm::AllReduceOptions().op(avg).async_op(true));
  }
  if (quant.reductions()) {
    return comm::quantized_reduce_scatter(groups.shard, groups.shard_nodes, grad_shard, grad_flat,
                                          comm::QuantizedOptions().block(quant.block()).op(avg).async_op(true).pool(pool));
  }
  return comm::reduce_scatter(groups.shard, grad_shard, grad_flat,
                              comm::ReduceScatterOptions().op(avg).workspace(workspace).async_op(true));
}

void all_reduce_replicas(const ShardGroups& groups, at::Tensor& grad_shard, const Quantization& quant,
                         util::BlockPool* pool) {
  if (groups.replicate.size() > 1 && groups.shard.size() > 1) {
    if (quant.reductions()) {
      comm::quantized_all_reduce(groups.replicate, grad_shard, comm::QuantizedOptions().block(quant.block()).pool(pool));
      return;
    }
    comm::all_reduce(groups.replicate, grad_shard, comm::AllReduceOptions().op(comm::ReduceOp::Avg));
  }
}

}  // namespace dtrain::fsdp::collectives
