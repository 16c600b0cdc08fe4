#pragma once
// Quantized collectives: an all-gather and a reduce-scatter that move block-quantized int8 values
// instead of the tensor's dtype (DeepSpeed ZeRO++'s qwZ and qgZ), for FSDP's parameter gathers and
// gradient reductions on slow links (--gather-quant, --reduce-quant; fsdp/fully_sharded_data_parallel.h).
//
// Design note [block quantization]
// --------------------------------
// A tensor of n elements is cut into blocks of `block` elements (the last one padded with zeros)
// and each block is quantized on its own, symmetrically: scale = max|x| / 127 (fp32; a block of
// zeros keeps scale 0 and divides by 1), q = round(x / scale) clamped to [-127, 127], as int8; dequantized, x' =
// q x scale, so |x - x'| <= scale / 2 = max|x| / 254 within each block: a per-block bound, so one
// large value spoils only its own block (ZeRO++ quantizes by blocks for the same reason). A packed
// tensor is one byte buffer: the fp32 scales of every block, then the int8 values (blocks x
// `block` bytes, padding included), so one collective moves both and every rank's part starts on a
// 4-byte boundary ((block + 4) x blocks bytes, `block` a multiple of 4). On the wire that is
// (block + 4) / block bytes per element: 1.016 at the default 256, 3.94x fewer than fp32 and 1.97x
// fewer than bf16.
//   - The all-gather quantizes this rank's input, all-gathers the packed bytes and dequantizes
//     every rank's part (its own too: every rank computes with the same values) into the output.
//   - The reduce-scatter quantizes each destination's part of the input separately, exchanges them
//     with one all-to-all (as ZeRO++'s qgZ: a ring would re-quantize at every hop), dequantizes the
//     W parts it received and sums them in fp32 (then / W for Avg) into its output.
//   - The all-reduce is that reduce-scatter (the tensor padded to W equal parts), then the
//     all-gather of the reduced parts: each value quantized twice (by its sender, then as part of
//     its owner's reduced part), the bytes those two move: 3.9x fewer than fp32's ring all-reduce
//     (HSDP's all-reduce across replicas, which crosses nodes, under --reduce-quant).
//   - Two levels (where the group spans nodes, each holding the same number L of its members): a
//     flat all-to-all sends (W - L) of each rank's W parts to other nodes, so across nodes it moves
//     more than a ring would. quantized_reduce_scatter given NodeGroups works as ZeRO++'s
//     hierarchical qgZ instead: an all-to-all inside the node gives each rank, for every node, the
//     sum of its node's parts for the rank with its local index there (dequantized, summed in fp32);
//     those n partial sums, quantized again, cross by one all-to-all among the ranks of one local
//     index: n - 1 parts across per rank, L times fewer than the flat all-to-all.
// All are deterministic (the same bytes on every rank, summed in rank order), so the result equals
// the formula computed on one process exactly (tests/comm).
//
// Design note [fp8 blocks]
// ------------------------
// QuantFormat::Fp8 stores each value as float8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3
// mantissa bits; no infinities; largest 448; torchao's float8 all-gather for FSDP2) in the same
// packed layout, the block's scale max|x| / 448: a relative error of at most 2^-4 where int8's is
// absolute (max|x| / 254), so the small values of a block keep 3 significant bits instead of
// rounding to 0 or to one step of the block's largest. Encoded and decoded by the library itself
// (libtorch 1.13 has no float8 dtype, and one code on every version gives every rank the same
// bytes): y = |x| / scale is rounded to a multiple of its binade's spacing 2^(E - 3) (2^-9 below
// 2^-6, the subnormals), half to even as IEEE's round-to-nearest-even, the spacing read from y's
// fp32 exponent bits, and the multiple is the code's low bits (a carry to the next binade included);
// the sign in the top bit. Decoding is a lookup in the 256-entry table. Below 2^-6 x scale the
// error is at most 2^-10 x scale. (Encoding costs about 2.5x int8's on this CPU, decoding the same.)
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include "dtrain/comm/node_groups.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/types.h"
#include "dtrain/comm/work.h"

namespace dtrain::util {
class BlockPool;  // (util/block_pool.h)
}  // namespace dtrain::util

namespace dtrain::comm {

// How each value of a block is stored in its byte (Design notes [block quantization], [fp8 blocks]).
enum class QuantFormat {
  Int8,  // round(x / scale), scale = max|x| / 127
  Fp8,   // float8 e4m3fn of x / scale, scale = max|x| / 448
};
const char* to_string(QuantFormat f);  // "int8", "fp8"

struct QuantizedOptions {
  TORCH_ARG(int64_t, block) = 256;  // elements per scale; a positive multiple of 4
  TORCH_ARG(QuantFormat, format) = QuantFormat::Int8;
  TORCH_ARG(ReduceOp, op) = ReduceOp::Avg;  // reduce-scatter: Sum or Avg
  TORCH_ARG(bool, async_op) = false;
  // Where the packed buffers (this rank's, the gathered or received ones, the workspaces) come
  // from and go back to once the work is done (Design note [buffers reused], util/block_pool.h:
  // FSDP passes its pool); nullptr: allocated per call. On the CPU the fp32 temporaries are a
  // slice's (64K values over all the rows: under 1 MiB) whatever the tensor's size.
  using Pool = util::BlockPool*;  // (TORCH_ARG spells the type textually)
  TORCH_ARG(Pool, pool) = nullptr;
};

// Bytes of one packed tensor of n elements (scales and values).
int64_t quantized_bytes(int64_t n, int64_t block);
// Quantizes each row of `x` (rows x n, any floating dtype, contiguous or not) into one packed row:
// a (rows x quantized_bytes(n, block)) kByte tensor on x's device.
at::Tensor quantize_blocks(const at::Tensor& x, int64_t block, QuantFormat format = QuantFormat::Int8);
// The inverse: fills `out` (rows x n, any floating dtype, written through copy_) from `packed`.
void dequantize_blocks(const at::Tensor& packed, int64_t block, at::Tensor& out,
                       QuantFormat format = QuantFormat::Int8);
// The value of every float8 e4m3fn code (256 fp32 values; 0x7f and 0xff are NaN), on `device`.
at::Tensor fp8_values(at::Device device = at::kCPU);

// `output` (W x input.numel(), contiguous, floating) gets every rank's `input` quantized and
// dequantized, rank r's at r x input.numel(). Every rank passes the same numel.
Work quantized_all_gather(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                          const QuantizedOptions& options = {});


// `tensor` (contiguous, floating) becomes the sum (or mean) over the ranks, as the note's
// all-reduce computes it; a group of one leaves it as it is.
Work quantized_all_reduce(const ProcessGroup& pg, at::Tensor& tensor, const QuantizedOptions& options = {});

// `output` (input.numel() / W elements, floating) gets this rank's part of the sum (or mean) over
// the ranks of their `input`s, each part quantized by its sender; input.numel() divisible by W.
// Works, and sums, in fp32 whatever the dtypes.
Work quantized_reduce_scatter(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                              const QuantizedOptions& options = {});
// The same in two levels (the note) where `nodes` (split_by_node(pg)) has them, else flat.
Work quantized_reduce_scatter(const ProcessGroup& pg, const NodeGroups& nodes, at::Tensor& output,
                              const at::Tensor& input, const QuantizedOptions& options = {});

}  // namespace dtrain::comm
