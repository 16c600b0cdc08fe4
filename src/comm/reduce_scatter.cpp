#include "dtrain/comm/reduce_scatter.h"

#include <algorithm>

#include "detail.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/comm/split.h"

namespace dtrain::comm {

namespace {

void reduce_rows(at::Tensor& out, const at::Tensor& rows, ReduceOp op, int world) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg: {
      // Reduced-precision rows are summed in float32 (as the upcasting all_reduce does).
      // Full-precision rows are summed straight into `out` (no temporary of the part's size).
      // (narrow rows on the CPU a slice of columns at a time: the float32 sums, for which ATen
      // converts the rows first, stay under 1 MiB whatever the part's size and the world's)
      const bool narrow = rows.scalar_type() == at::kBFloat16 || rows.scalar_type() == at::kHalf;
      if (narrow || !out.is_contiguous()) {
        constexpr int64_t kSlice = 64 * 1024;  // (elements of the float32 rows a slice)
        const int64_t n = rows.size(1);
        const int64_t step = narrow && rows.is_cpu() ? std::max<int64_t>(1, kSlice / rows.size(0)) : std::max<int64_t>(n, 1);
        for (int64_t c = 0; c < n; c += step) {
          const int64_t len = std::min(step, n - c);
          // (in row order, one add after the other: the formula's order whatever the world)
          const at::Tensor slice = rows.narrow(1, c, len);
          at::Tensor acc = narrow ? slice[0].to(at::kFloat, /*non_blocking=*/false, /*copy=*/true) : slice[0].clone();
          for (int64_t r = 1; r < slice.size(0); ++r) acc.add_(slice[r]);
          if (op == ReduceOp::Avg) acc.div_(world);
          out.narrow(0, c, len).copy_(acc);
        }
      } else {
        const int64_t first = 0;
        at::sum_out(out, rows, at::IntArrayRef(first));
        if (op == ReduceOp::Avg) out.div_(world);
      }
      break;
    }
    case ReduceOp::Max: out.copy_(std::get<0>(rows.max(0))); break;
    case ReduceOp::Min: out.copy_(std::get<0>(rows.min(0))); break;
  }
}

}  // namespace

bool reduce_scatter_uses_workspace(const ProcessGroup& pg) { return pg.size() > 1 && pg.backend_kind() != BackendKind::Nccl; }

// How the flat reduce-scatter is done:
//  - NCCL: _reduce_scatter_base (parts padded to the largest count when uneven).
//  - Gloo (no reduce-scatter in libtorch 1.13): all_to_all of the parts, rank j receiving part j
//    from everyone, then a local reduction of the W received rows. Each rank sends and receives
//    (W-1)/W of the input: the bytes of a ring reduce-scatter, half those of an all-reduce.
Work reduce_scatter(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options) {
  const int world = pg.size();
  const int rank = pg.rank();
  const auto ctx = detail::context(pg, "reduce_scatter", input, to_string(options.op()));
  detail::check_input_output(ctx, input, output);
  TORCH_CHECK(options.op() != ReduceOp::Avg || at::isFloatingType(input.scalar_type()), ctx,
              ": avg needs a floating-point tensor");
  std::vector<int64_t> counts = options.counts();
  if (counts.empty()) counts = even_split(input.numel(), world);
  TORCH_CHECK(static_cast<int>(counts.size()) == world, ctx, ": counts has ", counts.size(),
              " entries for a group of ", world);
  const auto offsets = offsets_of(counts);
  TORCH_CHECK(offsets.back() == input.numel(), ctx, ": the counts add up to ", offsets.back(),
              " but the input has ", input.numel(), " elements");
  TORCH_CHECK(output.numel() == counts[rank], ctx, ": output has ", output.numel(),
              " elements, this rank's part has ", counts[rank]);
  detail::verify_same_call(pg, ctx, 4,
                           {static_cast<int64_t>(options.op()),
                            static_cast<int64_t>(input.scalar_type()), input.numel()});
  at::Tensor out_flat = output.view({-1});
  if (world == 1) {
    out_flat.copy_(input.view({-1}));
    return Work();
  }
  if (input.numel() == 0) return Work();
  const ReduceOp op = options.op();
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  detail::count_traffic(detail::TrafficKind::ReduceScatter, static_cast<int64_t>(input.nbytes()), pg, -1,
                        /*direct=*/pg.backend_kind() != BackendKind::Nccl);  // (Gloo: an all-to-all)

  if (pg.backend_kind() == BackendKind::Nccl) {
    const bool even = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == max_count; });
    at::Tensor in_flat = input.view({-1});
    at::Tensor padded_out = out_flat;
    if (!even) {
      in_flat = at::zeros({max_count * world}, input.options());
      for (int r = 0; r < world; ++r) {
        in_flat.narrow(0, r * max_count, counts[r]).copy_(input.view({-1}).narrow(0, offsets[r], counts[r]));
      }
      padded_out = at::empty({max_count}, input.options());
    }
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = detail::to_c10d(op);
    std::function<void()> then = [padded_out, out_flat, even, op, world, rank, counts]() mutable {
      if (!even) out_flat.copy_(padded_out.narrow(0, 0, counts[rank]));
      if (op == ReduceOp::Avg) out_flat.div_(world);
    };
    return detail::launch(pg, ctx, [&] { return pg.backend()._reduce_scatter_base(padded_out, in_flat, opts); },
                          std::move(then), options.async_op());
  }

  at::Tensor in_flat = input.view({-1});
  at::Tensor received;
  if (options.workspace().defined()) {
    received = detail::workspace_view(ctx, options.workspace(), input, world * counts[rank]);
  } else {
    received = at::empty({world * counts[rank]}, input.options());
  }
  // Any dtype travels as bytes (see detail::as_wire); splits are scaled to match.
  const int64_t scale = detail::wire_scale(pg, input);
  std::vector<int64_t> input_splits = counts;
  for (auto& c : input_splits) c *= scale;
  std::vector<int64_t> output_splits(world, counts[rank] * scale);
  at::Tensor wire_in = detail::as_wire(pg, in_flat);
  at::Tensor wire_received = detail::as_wire(pg, received);
  std::function<void()> then = [received, out_flat, op, world, rank, counts]() mutable {
    reduce_rows(out_flat, received.view({world, counts[rank]}), op, world);
  };
  c10d::AllToAllOptions opts;
  return detail::launch(pg, 
      ctx, [&] { return pg.backend().alltoall_base(wire_received, wire_in, output_splits, input_splits, opts); },
      std::move(then), options.async_op());
}

}  // namespace dtrain::comm
