#include "dtrain/comm/all_gather.h"

#include <algorithm>
#include <cstring>

#include "detail.h"
#include "dtrain/comm/traffic.h"
#include "dtrain/comm/split.h"

namespace dtrain::comm {

// How the flat all-gather is done (libtorch 1.13's Gloo has no _allgather_base):
//  - NCCL: _allgather_base straight into the flat output.
//  - Gloo: the list form of allgather, whose outputs are views into the flat output (Gloo copies
//    them out of a flat buffer it allocates); with a workspace, an all-to-all of the input's W
//    copies straight into the output (AllGatherOptions::workspace), uneven counts too.
//  - Uneven counts otherwise: every rank pads its part to the largest count, the padded parts are gathered
//    into a scratch buffer and compacted into the output when the work completes.
bool all_gather_uses_workspace(const ProcessGroup& pg) { return pg.size() > 1 && pg.backend_kind() != BackendKind::Nccl; }

Work all_gather(const ProcessGroup& pg, at::Tensor& output, const at::Tensor& input,
                const AllGatherOptions& options) {
  const int world = pg.size();
  const auto ctx = detail::context(pg, "all_gather", input);
  detail::check_input_output(ctx, input, output);
  std::vector<int64_t> counts = options.counts();
  if (counts.empty()) counts.assign(world, input.numel());
  TORCH_CHECK(static_cast<int>(counts.size()) == world, ctx, ": counts has ", counts.size(),
              " entries for a group of ", world);
  TORCH_CHECK(counts[pg.rank()] == input.numel(), ctx, ": this rank's count is ", counts[pg.rank()],
              " but its input has ", input.numel(), " elements");
  const auto offsets = offsets_of(counts);
  TORCH_CHECK(output.numel() == offsets.back(), ctx, ": output has ", output.numel(),
              " elements, the counts add up to ", offsets.back());
  detail::verify_same_call(pg, ctx, 3,
                           {static_cast<int64_t>(input.scalar_type()), output.numel(),
                            static_cast<int64_t>(options.workspace().defined())});  // (uneven: numels differ)
  if (world == 1) {
    output.view({-1}).copy_(input.view({-1}));
    return Work();
  }
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  const bool even = std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == max_count; });
  if (max_count == 0) return Work();

  at::Tensor in_flat = input.view({-1});
  at::Tensor out_flat = output.view({-1});
  // (Gloo with a workspace: an all-to-all of this rank's W copies, uneven counts too, straight into
  // the output)
  const bool direct = pg.backend_kind() != BackendKind::Nccl && options.workspace().defined();
  if (direct) {
    detail::count_traffic(detail::TrafficKind::AllGather, static_cast<int64_t>(output.nbytes()), pg, -1, /*direct=*/true);
    const int64_t scale = detail::wire_scale(pg, input);
    at::Tensor copies = detail::workspace_view(ctx, options.workspace(), input, world * input.numel());
    copies.view({world, input.numel()}).copy_(in_flat.view({1, input.numel()}).expand({world, input.numel()}));
    std::vector<int64_t> in_splits(world, input.numel() * scale), out_splits = counts;
    for (auto& c : out_splits) c *= scale;
    at::Tensor wire_in = detail::as_wire(pg, copies), wire_out = detail::as_wire(pg, out_flat);
    c10d::AllToAllOptions opts;
    return detail::launch(pg, ctx, [&] { return pg.backend().alltoall_base(wire_out, wire_in, out_splits, in_splits, opts); },
                          nullptr, options.async_op());
  }
  at::Tensor gather_into = out_flat;  // where the backend writes (padded scratch when uneven)
  std::function<void()> then;
  if (!even) {
    in_flat = at::zeros({max_count}, input.options());
    in_flat.narrow(0, 0, input.numel()).copy_(input.view({-1}));
    gather_into = at::empty({max_count * world}, input.options());
    then = [gather_into, out_flat, counts, offsets, max_count]() mutable {
      for (size_t r = 0; r < counts.size(); ++r) {
        out_flat.narrow(0, offsets[r], counts[r]).copy_(gather_into.narrow(0, r * max_count, counts[r]));
      }
    };
  }
  detail::count_traffic(detail::TrafficKind::AllGather, static_cast<int64_t>(output.nbytes()), pg, -1, /*direct=*/false);
  if (pg.backend_kind() == BackendKind::Nccl) {
    return detail::launch(pg, ctx, [&] { return pg.backend()._allgather_base(gather_into, in_flat); },
                          std::move(then), options.async_op());
  }
  const int64_t scale = detail::wire_scale(pg, input);
  at::Tensor wire_out = detail::as_wire(pg, gather_into);
  std::vector<at::Tensor> inputs{detail::as_wire(pg, in_flat)};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < world; ++r) {
    outputs[0].push_back(wire_out.narrow(0, r * max_count * scale, max_count * scale));
  }
  return detail::launch(pg, ctx, [&] { return pg.backend().allgather(outputs, inputs); }, std::move(then),
                        options.async_op());
}

std::vector<std::string> all_gather_text(const ProcessGroup& pg, const std::string& mine) {
  const int world = pg.size();
  const auto dev = pg.device();
  at::Tensor lens = at::empty({world}, at::TensorOptions(at::kLong).device(dev));
  all_gather(pg, lens, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong).to(dev));
  lens = lens.cpu();
  std::vector<int64_t> counts(lens.data_ptr<int64_t>(), lens.data_ptr<int64_t>() + world);
  int64_t total = 0;
  for (auto c : counts) total += c;
  at::Tensor in = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  if (!mine.empty()) std::memcpy(in.data_ptr(), mine.data(), mine.size());
  at::Tensor out = at::empty({total}, at::TensorOptions(at::kByte).device(dev));
  all_gather(pg, out, in.to(dev), AllGatherOptions().counts(counts));
  out = out.cpu();
  std::vector<std::string> result;
  const char* p = static_cast<const char*>(out.data_ptr());
  for (auto c : counts) {
    result.emplace_back(p, static_cast<size_t>(c));
    p += c;
  }
  return result;
}

}  // namespace dtrain::comm
