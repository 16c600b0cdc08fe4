#pragma once
// FSDP's wire quantization (DeepSpeed ZeRO++'s qwZ and qgZ): a unit's parameters all-gathered, and
// its gradients reduce-scattered, as block-quantized int8 (Design note [block quantization],
// comm/quantized.h): 3.9x fewer bytes than fp32, 1.97x fewer than bf16, for slow links. Gathers
// may be fp8 instead (Design note [fp8 blocks]: the same bytes, a relative error per value).
//   - gathers: every rank computes with the gathered values quantized, its own part's too; the
//     master shards (and the optimizer) stay exact: each step's error is that of one quantization
//     of the current weights, not accumulated.
//   - reductions: each rank's gradient parts quantized once, exchanged by one all-to-all, summed in
//     fp32; HSDP's all-reduce across replicas (across nodes, where the shard group is a node)
//     quantized too (comm::quantized_all_reduce). NoShard's all-reduce stays in the reduce dtype.
// With one shard (NoShard, or a shard group of one) there is nothing to gather or scatter.
#include <cstdint>

#include <torch/arg.h>

#include "dtrain/comm/quantized.h"

namespace dtrain::fsdp {

struct Quantization {
  TORCH_ARG(bool, gathers) = false;     // --gather-quant int8|fp8
  TORCH_ARG(comm::QuantFormat, gather_format) = comm::QuantFormat::Int8;  // fp8: Design note [fp8 blocks]
  TORCH_ARG(bool, reductions) = false;  // --reduce-quant int8
  TORCH_ARG(int64_t, block) = 256;      // elements per scale (a multiple of 4)
};

}  // namespace dtrain::fsdp
