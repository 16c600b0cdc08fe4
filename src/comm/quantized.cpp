// Block-quantized all-gather and reduce-scatter (Design note [block quantization], comm/quantized.h).
#include "dtrain/comm/quantized.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "detail.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_to_all.h"
#include "dtrain/util/block_pool.h"

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

namespace {
// Values quantized, dequantized or summed at a time on the CPU, over all the rows at once (at
// least a block a row): a slice's fp32 temporaries stay under 1 MiB whatever the tensor's size,
// while rows x block stay within it (Design note [buffers reused], util/block_pool.h). On a GPU one slice (a kernel per
// step, as before; the caching allocator keeps the temporaries).
constexpr int64_t kSliceValues = 64 * 1024;

// The blocks of a slice of `rows` rows of blocks of `block` values on `t`'s device.
int64_t slice_blocks(int64_t rows, int64_t block, const at::Tensor& t) {
  if (!t.is_cpu()) return std::numeric_limits<int64_t>::max();
  return std::max<int64_t>(1, kSliceValues / std::max<int64_t>(1, rows * block));
}

// One slice of a packed row: blocks [b0, b0 + len) of a row of n values, nb blocks in all.
struct Slice {
  int64_t n, nb, block, b0, len;
  int64_t first() const { return b0 * block; }                               // its first value
  int64_t values() const { return std::min(len * block, n - first()); }      // its values in the row
};

// Quantizes `src` (the slice's values, any floating dtype) into packed row `dst`.
void quantize_slice(const at::Tensor& src, at::Tensor dst, const Slice& s, QuantFormat format) {
  at::Tensor blocks = at::zeros({s.len * s.block}, src.options().dtype(at::kFloat));
  blocks.narrow(0, 0, s.values()).copy_(src);
  const at::Tensor b = blocks.view({s.len, s.block});
  const double top = format_max(format);
  const at::Tensor scale = b.abs().amax({1}).div_(top);
  const at::Tensor divisor = at::where(scale > 0, scale, at::ones_like(scale));
  dst.narrow(0, s.b0 * 4, s.len * 4).copy_(scale.view(at::kByte));
  const at::Tensor scaled = b.div(divisor.unsqueeze(1)).clamp_(-top, top);
  at::Tensor values = dst.narrow(0, s.nb * 4 + s.first(), s.len * s.block);
  if (format == QuantFormat::Fp8) {
    values.copy_(fp8_encode(scaled).view({-1}));
  } else {
    values.view(at::kChar).copy_(scaled.round_().view({-1}));
  }
}

// The slice's values of packed row `src`, in fp32 (len x block; the last block's padding too).
// `table`: fp8_values (undefined for int8).
at::Tensor dequantize_slice(const at::Tensor& src, const Slice& s, QuantFormat format, const at::Tensor& table) {
  const at::Tensor scale = src.narrow(0, s.b0 * 4, s.len * 4).contiguous().view(at::kFloat);
  const at::Tensor bytes = src.narrow(0, s.nb * 4 + s.first(), s.len * s.block);
  at::Tensor values = format == QuantFormat::Fp8 ? table.index_select(0, bytes.to(at::kLong)) : bytes.view(at::kChar).to(at::kFloat);
  return values.view({s.len, s.block}).mul_(scale.unsqueeze(1)).view({-1});
}

// Calls fn(slice) for every slice of a row of n values, `per` blocks a slice (slice_blocks).
template <class Fn>
void for_slices(int64_t n, int64_t block, int64_t per, Fn&& fn) {
  const int64_t nb = blocks_of(n, block);
  for (int64_t b0 = 0; b0 < nb; b0 += per) fn(Slice{n, nb, block, b0, std::min(per, nb - b0)});
}

// The slice of `count` packed rows of `received` (rows first, first + stride, ...) dequantized and
// summed in fp32 in row order, one add after the other (the formula's order, whatever the number of
// rows: ATen's sum over a dimension may pair them otherwise). `table`: fp8_table.
at::Tensor dequantized_sum(const at::Tensor& received, int64_t first, int64_t count, int64_t stride, const Slice& s,
                           QuantFormat format, const at::Tensor& table) {
  at::Tensor acc = dequantize_slice(received[first], s, format, table);
  for (int64_t i = 1; i < count; ++i) acc.add_(dequantize_slice(received[first + i * stride], s, format, table));
  return acc;
}

at::Tensor fp8_table(QuantFormat format, at::Device device) {
  return format == QuantFormat::Fp8 ? fp8_values(device) : at::Tensor();
}

// `x` (rows x n) quantized into `packed` (rows x quantized_bytes(n, block)).
void quantize_into(const at::Tensor& x, int64_t block, QuantFormat format, at::Tensor packed) {
  at::NoGradGuard no_grad;
  for (int64_t r = 0; r < x.size(0); ++r) {
    const at::Tensor row = x[r];
    for_slices(x.size(1), block, slice_blocks(1, block, x),
               [&](const Slice& s) { quantize_slice(row.narrow(0, s.first(), s.values()), packed[r], s, format); });
  }
}

// The rows of `received` (packed, rows x part values) dequantized and summed in fp32 in row
// order, divided by `world` for Avg, into `output`; a slice at a time.
void sum_rows_into(at::Tensor& output, const at::Tensor& received, int64_t rows, int64_t part, int64_t block,
                   QuantFormat format, int world, bool avg) {
  const at::Tensor table = fp8_table(format, received.device());
  at::Tensor out = output.view({-1});
  for_slices(part, block, slice_blocks(rows, block, received), [&](const Slice& s) {
    at::Tensor sum = dequantized_sum(received, 0, rows, 1, s, format, table);
    if (avg) sum.div_(world);
    out.narrow(0, s.first(), s.values()).copy_(sum.narrow(0, 0, s.values()));
  });
}
}  // namespace

at::Tensor quantize_blocks(const at::Tensor& x, int64_t block, QuantFormat format) {
  check_block(block);
  TORCH_CHECK(x.dim() == 2 && at::isFloatingType(x.scalar_type()), "quantize_blocks: expects rows x n floating "
              "values, got ", x.sizes(), " ", x.scalar_type());
  at::Tensor packed = at::empty({x.size(0), quantized_bytes(x.size(1), block)}, x.options().dtype(at::kByte));
  quantize_into(x, block, format, packed);
  return packed;
}

void dequantize_blocks(const at::Tensor& packed, int64_t block, at::Tensor& out, QuantFormat format) {
  check_block(block);
  TORCH_CHECK(out.dim() == 2 && packed.dim() == 2 && packed.size(0) == out.size(0) &&
                  packed.size(1) == quantized_bytes(out.size(1), block) && packed.scalar_type() == at::kByte,
              "dequantize_blocks: ", packed.sizes(), " packed bytes do not hold ", out.sizes(), " values in blocks of ",
              block);
  at::NoGradGuard no_grad;
  const at::Tensor table = fp8_table(format, packed.device());
  for (int64_t r = 0; r < out.size(0); ++r) {
    at::Tensor row = out[r];
    for_slices(out.size(1), block, slice_blocks(1, block, packed), [&](const Slice& s) {
      row.narrow(0, s.first(), s.values()).copy_(dequantize_slice(packed[r], s, format, table).narrow(0, 0, s.values()));
    });
  }
}

namespace {
// A flat buffer of n elements from the options' pool (or allocated), given back once used.
at::Tensor buffer(int64_t n, const at::TensorOptions& o, const QuantizedOptions& options) {
  return util::pooled_empty(n, o, options.pool());
}
void give_back(std::initializer_list<at::Tensor> buffers, util::BlockPool* pool) {
  for (const at::Tensor& t : buffers) {
    if (t.defined()) util::give_back(t, pool);
  }
}
}  // namespace

Work quantized_all_gather(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                          const QuantizedOptions& options) {
  const auto ctx = detail::context(pg, "quantized_all_gather", input);
  detail::check_tensor(ctx, input, "input");
  detail::check_tensor(ctx, output, "output");
  const int world = pg.size();
  const int64_t n = input.numel();
  TORCH_CHECK(output.numel() == world * n && at::isFloatingType(output.scalar_type()), ctx, ": the output must hold ",
              world, " x ", n, " floating values, it has ", output.numel(), " ", output.scalar_type());
  const int64_t block = options.block(), bytes = quantized_bytes(n, block);
  check_block(block);
  const QuantFormat format = options.format();
  const at::TensorOptions packed = input.options().dtype(at::kByte);
  at::Tensor mine = buffer(bytes, packed, options);
  quantize_into(input.view({1, n}), block, format, mine.view({1, bytes}));
  at::Tensor gathered = buffer(world * bytes, packed, options);
  at::Tensor workspace;  // (Gloo: the all-to-all straight into `gathered`, comm/all_gather.h)
  if (all_gather_uses_workspace(pg)) workspace = buffer(world * bytes, packed, options);
  Work w = all_gather(pg, gathered, mine, AllGatherOptions().workspace(workspace).async_op(true));
  util::BlockPool* pool = options.pool();
  Work done = Work::after(std::move(w), [output, gathered, mine, workspace, world, n, block, format, pool]() mutable {
    at::Tensor rows = output.view({world, n});
    dequantize_blocks(gathered.view({world, -1}), block, rows, format);
    give_back({mine, gathered, workspace}, pool);
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
  check_block(block);
  const int64_t bytes = quantized_bytes(part, block);
  const QuantFormat format = options.format();
  const at::TensorOptions packed = input.options().dtype(at::kByte);
  at::Tensor sent = buffer(world * bytes, packed, options).view({world, bytes});  // row r: rank r's part
  quantize_into(input.view({world, part}), block, format, sent);
  at::Tensor received = buffer(world * bytes, packed, options).view({world, bytes});
  Work w = all_to_all(pg, received, sent, AllToAllOptions().async_op(true));
  const bool avg = options.op() == ReduceOp::Avg;
  util::BlockPool* pool = options.pool();
  Work done = Work::after(std::move(w), [output, received, sent, world, part, block, format, avg, pool]() mutable {
    sum_rows_into(output, received, world, part, block, format, world, avg);
    give_back({sent, received}, pool);
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
  const at::TensorOptions f32 = tensor.options().dtype(at::kFloat);
  at::Tensor padded = buffer(world * part, f32, options);
  padded.narrow(0, n, world * part - n).zero_();
  padded.narrow(0, 0, n).copy_(tensor.view({-1}));
  at::Tensor mine = buffer(part, f32, options);
  Work first = quantized_reduce_scatter(pg, mine, padded, QuantizedOptions(options).async_op(true));
  const QuantFormat format = options.format();
  util::BlockPool* pool = options.pool();
  Work done = Work::after(std::move(first), [pg, tensor, mine, padded, world, part, n, block, format, pool]() mutable {
    // (the input is consumed: reuse it)
    quantized_all_gather(pg, padded, mine, QuantizedOptions().block(block).format(format).pool(pool));
    tensor.view({-1}).copy_(padded.narrow(0, 0, n));
    give_back({padded, mine}, pool);
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
  const int64_t part = output.numel(), block = options.block();
  check_block(block);
  const int64_t bytes = quantized_bytes(part, block);
  const QuantFormat format = options.format();
  const at::TensorOptions packed = input.options().dtype(at::kByte);
  // Rows to send inside the node: for each local index l' (the receiver), the parts of the
  // destinations with that local index on every node, nodes in order.
  at::Tensor sent = buffer(local * n * bytes, packed, options).view({local * n, bytes});
  const at::Tensor parts_in = input.view({world, part});
  for (int l = 0; l < local; ++l) {
    for (int b = 0; b < n; ++b) {
      const int dest = lists[static_cast<size_t>(b)][static_cast<size_t>(l)];
      quantize_into(parts_in.narrow(0, dest, 1), block, format, sent.narrow(0, l * n + b, 1));
    }
  }
  at::Tensor received = buffer(local * n * bytes, packed, options).view({local * n, bytes});
  Work w = all_to_all(nodes.within, received, sent, AllToAllOptions().async_op(true));
  const bool avg = options.op() == ReduceOp::Avg;
  const ProcessGroup across = nodes.across;
  util::BlockPool* pool = options.pool();
  const QuantizedOptions o = options;
  Work done = Work::after(std::move(w), [output, received, sent, across, world, local, n, part, block, bytes, format, avg,
                                         pool, o]() mutable {
    // Row b of this node's sums for node b, quantized a slice at a time as it is summed.
    at::Tensor sent2 = buffer(n * bytes, received.options(), o).view({n, bytes});
    const at::Tensor table = fp8_table(format, received.device());
    for_slices(part, block, slice_blocks(local * n, block, received), [&](const Slice& s) {
      for (int b = 0; b < n; ++b) {  // (row l * n + b: local peer l's part for node b)
        const at::Tensor partial = dequantized_sum(received, b, local, n, s, format, table);
        quantize_slice(partial.narrow(0, 0, s.values()), sent2[b], s, format);
      }
    });
    at::Tensor received2 = buffer(n * bytes, received.options(), o).view({n, bytes});
    all_to_all(across, received2, sent2);
    sum_rows_into(output, received2, n, part, block, format, world, avg);
    give_back({sent, received, sent2, received2}, pool);
  });
  if (!options.async_op()) done.wait();
  return done;
}

}  // namespace dtrain::comm
