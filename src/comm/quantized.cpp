// Block-quantized all-gather and reduce-scatter (Design note [block quantization], comm/quantized.h).
#include "dtrain/comm/quantized.h"

#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "detail.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_to_all.h"

namespace dtrain::comm {

namespace {
int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

void check_block(int64_t block) {
  TORCH_CHECK(block > 0 && block % 4 == 0, "quantized collectives: the block must be a positive multiple of 4 "
              "elements (its values keep every rank's scales 4-byte aligned), got ", block);
}
}  // namespace

namespace {
// A quantized reduction's name for its errors, its tensors and its op checked.
std::string checked_reduction(const ProcessGroup& pg, const char* op_name, const at::Tensor& input,
                              const at::Tensor& output, const QuantizedOptions& options) {
  const auto ctx = detail::context(pg, op_name, input, to_string(options.op()));
  detail::check_tensor(ctx, input, "input");
  detail::check_tensor(ctx, output, "output");
  TORCH_CHECK(options.op() == ReduceOp::Sum || options.op() == ReduceOp::Avg, ctx, ": sums or averages only");
  return ctx;
}

// The rows of `received` (packed, rows x part values) dequantized and summed in fp32 in row order,
// divided by `world` for Avg, into `output`.
void sum_rows_into(at::Tensor& output, const at::Tensor& received, int64_t rows, int64_t part, int64_t block,
                   int world, bool avg) {
  at::Tensor parts = at::empty({rows, part}, output.options().dtype(at::kFloat));
  dequantize_blocks(received, block, parts);
  at::Tensor sum = parts.sum(0);
  if (avg) sum.div_(world);
  output.view({-1}).copy_(sum);
}
}  // namespace

int64_t quantized_bytes(int64_t n, int64_t block) {
  check_block(block);
  return blocks_of(n, block) * (block + 4);
}

at::Tensor quantize_blocks(const at::Tensor& x, int64_t block) {
  check_block(block);
  TORCH_CHECK(x.dim() == 2 && at::isFloatingType(x.scalar_type()), "quantize_blocks: expects rows x n floating "
              "values, got ", x.sizes(), " ", x.scalar_type());
  at::NoGradGuard no_grad;
  const int64_t rows = x.size(0), n = x.size(1), nb = blocks_of(n, block);
  at::Tensor padded = at::zeros({rows, nb * block}, x.options().dtype(at::kFloat));
  padded.narrow(1, 0, n).copy_(x);
  at::Tensor blocks = padded.view({rows * nb, block});
  at::Tensor scale = blocks.abs().amax({1}).div_(127.0);
  const at::Tensor divisor = at::where(scale > 0, scale, at::ones_like(scale));
  at::Tensor packed = at::empty({rows, nb * (block + 4)}, x.options().dtype(at::kByte));
  packed.narrow(1, 0, nb * 4).copy_(scale.view({rows, nb}).view(at::kByte));
  packed.narrow(1, nb * 4, nb * block).view(at::kChar).copy_(
      blocks.div(divisor.unsqueeze(1)).round_().clamp_(-127, 127).view({rows, nb * block}));
  return packed;
}

void dequantize_blocks(const at::Tensor& packed, int64_t block, at::Tensor& out) {
  check_block(block);
  TORCH_CHECK(out.dim() == 2 && packed.dim() == 2 && packed.size(0) == out.size(0) &&
                  packed.size(1) == quantized_bytes(out.size(1), block) && packed.scalar_type() == at::kByte,
              "dequantize_blocks: ", packed.sizes(), " packed bytes do not hold ", out.sizes(), " values in blocks of ",
              block);
  at::NoGradGuard no_grad;
  const int64_t rows = out.size(0), n = out.size(1), nb = blocks_of(n, block);
  const at::Tensor scale = packed.narrow(1, 0, nb * 4).contiguous().view(at::kFloat);  // rows x nb
  const at::Tensor values = packed.narrow(1, nb * 4, nb * block).view(at::kChar).to(at::kFloat);
  out.copy_(values.view({rows, nb, block}).mul_(scale.unsqueeze(2)).view({rows, nb * block}).narrow(1, 0, n));
}

Work quantized_all_gather(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                          const QuantizedOptions& options) {
  const auto ctx = detail::context(pg, "quantized_all_gather", input);
  detail::check_tensor(ctx, input, "input");
  detail::check_tensor(ctx, output, "output");
  const int world = pg.size();
  const int64_t n = input.numel();
  TORCH_CHECK(output.numel() == world * n && at::isFloatingType(output.scalar_type()), ctx, ": the output must hold ",
              world, " x ", n, " floating values, it has ", output.numel(), " ", output.scalar_type());
  const at::Tensor mine = quantize_blocks(input.view({1, n}), options.block());
  at::Tensor gathered = at::empty({world * mine.numel()}, mine.options());
  Work w = all_gather(pg, gathered, mine.view({-1}), AllGatherOptions().async_op(true));
  const int64_t block = options.block();
  Work done = Work::after(std::move(w), [output, gathered, mine, world, n, block]() mutable {
    at::Tensor rows = output.view({world, n});
    dequantize_blocks(gathered.view({world, -1}), block, rows);
  });
  if (!options.async_op()) done.wait();
  return done;
}

Work quantized_reduce_scatter(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                              const QuantizedOptions& options) {
  const auto ctx = checked_reduction(pg, "quantized_reduce_scatter", input, output, options);
  const int world = pg.size();
  TORCH_CHECK(input.numel() % world == 0 && output.numel() == input.numel() / world &&
                  at::isFloatingType(output.scalar_type()),
              ctx, ": the input's ", input.numel(), " elements must split evenly over ", world,
              " ranks into the output's ", output.numel(), " floating values");
  const int64_t part = output.numel(), block = options.block();
  const at::Tensor sent = quantize_blocks(input.view({world, part}), block);  // row r: rank r's part
  at::Tensor received = at::empty_like(sent);
  Work w = all_to_all(pg, received, sent, AllToAllOptions().async_op(true));
  const bool avg = options.op() == ReduceOp::Avg;
  Work done = Work::after(std::move(w), [output, received, sent, world, part, block, avg]() mutable {
    sum_rows_into(output, received, world, part, block, world, avg);
  });
  if (!options.async_op()) done.wait();
  return done;
}

Work quantized_all_reduce(const ProcessGroup& pg, at::Tensor& tensor, const QuantizedOptions& options) {
  const auto ctx = checked_reduction(pg, "quantized_all_reduce", tensor, tensor, options);
  TORCH_CHECK(at::isFloatingType(tensor.scalar_type()), ctx, ": quantizes floating-point tensors only");
  const int world = pg.size();
  if (world == 1) return Work();
  const int64_t n = tensor.numel(), part = (n + world - 1) / world, block = options.block();
  at::Tensor padded = at::zeros({world * part}, tensor.options().dtype(at::kFloat));
  padded.narrow(0, 0, n).copy_(tensor.view({-1}));
  at::Tensor mine = at::empty({part}, padded.options());
  Work first = quantized_reduce_scatter(pg, mine, padded, QuantizedOptions(options).async_op(true));
  Work done = Work::after(std::move(first), [pg, tensor, mine, padded, world, part, n, block]() mutable {
    quantized_all_gather(pg, padded, mine, QuantizedOptions().block(block));  // (the input is consumed: reuse it)
    tensor.view({-1}).copy_(padded.narrow(0, 0, n));
  });
  if (!options.async_op()) done.wait();
  return done;
}

Work quantized_reduce_scatter(const ProcessGroup& pg, const NodeGroups& nodes, at::Tensor& output,
                              const at::Tensor& input, const QuantizedOptions& options) {
  if (!nodes.two_level()) return quantized_reduce_scatter(pg, output, input, options);
  const auto ctx = checked_reduction(pg, "quantized_reduce_scatter (two levels)", input, output, options);
  const int world = pg.size(), local = nodes.within.size(), n = nodes.across.size();
  TORCH_CHECK(local * n == world && input.numel() % world == 0 && output.numel() == input.numel() / world &&
                  at::isFloatingType(output.scalar_type()),
              ctx, ": the input's ", input.numel(), " elements must split evenly over ", world, " ranks (", n,
              " nodes of ", local, ") into the output's ", output.numel(), " floating values");
  const std::vector<std::vector<int>> lists = members_by_node(pg);
  // Rows to send inside the node: for each local index l' (the receiver), the parts of the
  // destinations with that local index on every node, nodes in order.
  std::vector<int64_t> order;
  for (int l = 0; l < local; ++l) {
    for (int b = 0; b < n; ++b) order.push_back(lists[static_cast<size_t>(b)][static_cast<size_t>(l)]);
  }
  const int64_t part = output.numel(), block = options.block();
  const at::Tensor rows = input.view({world, part}).index_select(0, at::tensor(order, at::kLong).to(input.device()));
  const at::Tensor sent = quantize_blocks(rows, block);
  at::Tensor received = at::empty_like(sent);
  Work w = all_to_all(nodes.within, received, sent, AllToAllOptions().async_op(true));
  const bool avg = options.op() == ReduceOp::Avg;
  const ProcessGroup across = nodes.across;
  Work done = Work::after(std::move(w), [output, received, sent, across, world, local, n, part, block, avg]() mutable {
    at::Tensor parts = at::empty({local * n, part}, output.options().dtype(at::kFloat));
    dequantize_blocks(received, block, parts);
    const at::Tensor partial = parts.view({local, n, part}).sum(0);  // row b: this node's sum for node b
    const at::Tensor sent2 = quantize_blocks(partial, block);
    at::Tensor received2 = at::empty_like(sent2);
    all_to_all(across, received2, sent2);
    sum_rows_into(output, received2, n, part, block, world, avg);
  });
  if (!options.async_op()) done.wait();
  return done;
}

}  // namespace dtrain::comm
