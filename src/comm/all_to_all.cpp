#include "dtrain/comm/all_to_all.h"

#include <algorithm>
#include <numeric>

#include "detail.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::comm {

Work all_to_all(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                const AllToAllOptions& options) {
  const int world = pg.size();
  const auto ctx = detail::context(pg, "all_to_all", input);
  detail::check_input_output(ctx, input, output);
  TORCH_CHECK(input.dim() >= 1 && output.dim() >= 1, ctx, ": input and output need at least one dimension");
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t, const char* which) {
    if (splits.empty()) {
      TORCH_CHECK(t.size(0) % world == 0, ctx, ": the ", which, " has ", t.size(0),
                  " rows, not divisible by ", world, "; pass ", which, "_split_sizes");
      return;
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == world, ctx, ": ", which, "_split_sizes has ",
                splits.size(), " entries for a group of ", world);
    const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
    TORCH_CHECK(total == t.size(0), ctx, ": ", which, "_split_sizes add up to ", total, " but the ",
                which, " has ", t.size(0), " rows");
  };
  check_splits(options.input_split_sizes(), input, "input");
  check_splits(options.output_split_sizes(), output, "output");
  detail::verify_same_call(pg, ctx, 5, {static_cast<int64_t>(input.scalar_type())});
  if (world == 1) {
    output.copy_(input);
    return Work();
  }
  std::vector<int64_t> in_splits = options.input_split_sizes();
  std::vector<int64_t> out_splits = options.output_split_sizes();
  at::Tensor in = input;
  at::Tensor out = output;
  if (pg.backend_kind() == BackendKind::Gloo && !detail::gloo_supports(input.scalar_type())) {
    // Move the rows as bytes: flat byte views, splits scaled by the bytes per row.
    const int64_t row_bytes = input.numel() / std::max<int64_t>(1, input.size(0)) * input.element_size();
    const int64_t out_row_bytes = output.numel() / std::max<int64_t>(1, output.size(0)) * output.element_size();
    if (in_splits.empty()) in_splits.assign(world, input.size(0) / world);
    if (out_splits.empty()) out_splits.assign(world, output.size(0) / world);
    for (auto& s : in_splits) s *= row_bytes;
    for (auto& s : out_splits) s *= out_row_bytes;
    in = detail::as_wire(pg, input);
    out = detail::as_wire(pg, output);
  }
  c10d::AllToAllOptions opts;
  if (options.input_split_sizes().empty()) {
    detail::count_traffic(detail::TrafficKind::AllToAll, static_cast<int64_t>(input.nbytes()), pg);
  } else {  // (uneven: what goes to each member, exactly)
    const int64_t row_bytes = input.numel() / std::max<int64_t>(1, input.size(0)) * input.element_size();
    std::vector<int64_t> bytes_to = options.input_split_sizes();
    for (auto& b : bytes_to) b *= row_bytes;
    detail::count_all_to_all(bytes_to, pg);
  }
  return detail::launch(pg, ctx, [&] { return pg.backend().alltoall_base(out, in, out_splits, in_splits, opts); },
                        nullptr, options.async_op());
}

}  // namespace dtrain::comm
