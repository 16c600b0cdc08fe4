// Block-quantized all-gather and reduce-scatter (Design note [block quantization], comm/quantized.h).
#include "dtrain/comm/quantized.h"

#include <algorithm>
#include <cmath>
#include <limits>
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
                   QuantFormat format, int world, bool avg) {
  at::Tensor parts = at::empty({rows, part}, output.options().dtype(at::kFloat));
  dequantize_blocks(received, block, parts, format);
  at::Tensor sum = parts.sum(0);
  if (avg) sum.div_(world);
  output.view({-1}).copy_(sum);
}
}  // namespace

const char* to_string(QuantFormat f) { return f == QuantFormat::Fp8 ? "fp8" : "int8"; }

at::Tensor fp8_values(at::Device device) {
  std::vector<float> v(256);
  for (int code = 0; code < 256; ++code) {
    const int e = (code >> 3) & 15, m = code & 7;
    float a = e == 0 ? std::ldexp(static_cast<float>(m) / 8.0f, -6) : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
    if (e == 15 && m == 7) a = std::numeric_limits<float>::quiet_NaN();
    v[static_cast<size_t>(code)] = (code & 0x80) ? -a : a;
  }
  return at::tensor(v, at::kFloat).to(device);
}

namespace {
constexpr double kFp8Max = 448.0;

// The codes of `y` (fp32, |y| <= 448) under Design note [fp8 blocks]: nearest, ties to even.
at::Tensor fp8_encode(const at::Tensor& y) {
  at::Tensor a = y.abs();  // (fresh, contiguous: its bits are read below)
  // The spacing of e4m3 values in a's binade [2^E, 2^(E+1)), 2^(E - 3), from a's fp32 exponent
  // bits; below 2^-6 the subnormals' 2^-9.
  const at::Tensor q = a.view(at::kInt).bitwise_and(0x7F800000).sub_(3 << 23).view(at::kFloat).clamp_min_(1.0f / 512);
  // a / q exactly (q a power of 2), rounded half to even: 8..16 in a binade (16: the next one's
  // first value), 0..8 below 2^-6.
  const at::Tensor steps = a.div_(q).round_().to(at::kInt);
  // Code ((E + 7) << 3) + steps - 8, E + 124 being q's exponent field; below 2^-6 (q = 2^-9) that is
  // steps itself.
  at::Tensor code = q.view(at::kInt).bitwise_right_shift(20).sub_(944).add_(steps);
  return code.add_(y.lt(0).to(at::kInt).mul_(128)).to(at::kByte);
}

double format_max(QuantFormat f) { return f == QuantFormat::Fp8 ? kFp8Max : 127.0; }
}  // namespace

int64_t quantized_bytes(int64_t n, int64_t block) {
  check_block(block);
  return blocks_of(n, block) * (block + 4);
}

at::Tensor quantize_blocks(const at::Tensor& x, int64_t block, QuantFormat format) {
  check_block(block);
  TORCH_CHECK(x.dim() == 2 && at::isFloatingType(x.scalar_type()), "quantize_blocks: expects rows x n floating "
              "values, got ", x.sizes(), " ", x.scalar_type());
  at::NoGradGuard no_grad;
  const int64_t rows = x.size(0), n = x.size(1), nb = blocks_of(n, block);
  at::Tensor padded = at::zeros({rows, nb * block}, x.options().dtype(at::kFloat));
  padded.narrow(1, 0, n).copy_(x);
  at::Tensor blocks = padded.view({rows * nb, block});
  at::Tensor scale = blocks.abs().amax({1}).div_(format_max(format));
  const at::Tensor divisor = at::where(scale > 0, scale, at::ones_like(scale));
  at::Tensor packed = at::empty({rows, nb * (block + 4)}, x.options().dtype(at::kByte));
  packed.narrow(1, 0, nb * 4).copy_(scale.view({rows, nb}).view(at::kByte));
  const at::Tensor scaled = blocks.div(divisor.unsqueeze(1)).clamp_(-format_max(format), format_max(format));
  at::Tensor values = packed.narrow(1, nb * 4, nb * block);
  if (format == QuantFormat::Fp8) {
    values.copy_(fp8_encode(scaled).view({rows, nb * block}));
  } else {
    values.view(at::kChar).copy_(scaled.round_().view({rows, nb * block}));
  }
  return packed;
}

void dequantize_blocks(const at::Tensor& packed, int64_t block, at::Tensor& out, QuantFormat format) {
  check_block(block);
  TORCH_CHECK(out.dim() == 2 && packed.dim() == 2 && packed.size(0) == out.size(0) &&
                  packed.size(1) == quantized_bytes(out.size(1), block) && packed.scalar_type() == at::kByte,
              "dequantize_blocks: ", packed.sizes(), " packed bytes do not hold ", out.sizes(), " values in blocks of ",
              block);
  at::NoGradGuard no_grad;
  const int64_t rows = out.size(0), n = out.size(1), nb = blocks_of(n, block);
  const at::Tensor scale = packed.narrow(1, 0, nb * 4).contiguous().view(at::kFloat);  // rows x nb
  const at::Tensor bytes = packed.narrow(1, nb * 4, nb * block);
  const at::Tensor values = format == QuantFormat::Fp8
                                ? fp8_values(packed.device()).index_select(0, bytes.reshape({-1}).to(at::kLong)).view(bytes.sizes())
                                : bytes.view(at::kChar).to(at::kFloat);
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
  const int64_t block = options.block();
  const QuantFormat format = options.format();
  const at::Tensor mine = quantize_blocks(input.view({1, n}), block, format);
  at::Tensor gathered = at::empty({world * mine.numel()}, mine.options());
  Work w = all_gather(pg, gathered, mine.view({-1}), AllGatherOptions().async_op(true));
  Work done = Work::after(std::move(w), [output, gathered, mine, world, n, block, format]() mutable {
    at::Tensor rows = output.view({world, n});
    dequantize_blocks(gathered.view({world, -1}), block, rows, format);
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
  const QuantFormat format = options.format();
  const at::Tensor sent = quantize_blocks(input.view({world, part}), block, format);  // row r: rank r's part
  at::Tensor received = at::empty_like(sent);
  Work w = all_to_all(pg, received, sent, AllToAllOptions().async_op(true));
  const bool avg = options.op() == ReduceOp::Avg;
  Work done = Work::after(std::move(w), [output, received, sent, world, part, block, format, avg]() mutable {
    sum_rows_into(output, received, world, part, block, format, world, avg);
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
  const QuantFormat format = options.format();
  Work done = Work::after(std::move(first), [pg, tensor, mine, padded, world, part, n, block, format]() mutable {
    quantized_all_gather(pg, padded, mine, QuantizedOptions().block(block).format(format));  // (the input is consumed: reuse it)
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
  const QuantFormat format = options.format();
  const at::Tensor sent = quantize_blocks(rows, block, format);
  at::Tensor received = at::empty_like(sent);
  Work w = all_to_all(nodes.within, received, sent, AllToAllOptions().async_op(true));
  const bool avg = options.op() == ReduceOp::Avg;
  const ProcessGroup across = nodes.across;
  Work done = Work::after(std::move(w), [output, received, sent, across, world, local, n, part, block, format, avg]() mutable {
    at::Tensor parts = at::empty({local * n, part}, output.options().dtype(at::kFloat));
    dequantize_blocks(received, block, parts, format);
    const at::Tensor partial = parts.view({local, n, part}).sum(0);  // row b: this node's sum for node b
    const at::Tensor sent2 = quantize_blocks(partial, block, format);
    at::Tensor received2 = at::empty_like(sent2);
    all_to_all(across, received2, sent2);
    sum_rows_into(output, received2, n, part, block, format, world, avg);
  });
  if (!options.async_op()) done.wait();
  return done;
}

}  // namespace dtrain::comm
