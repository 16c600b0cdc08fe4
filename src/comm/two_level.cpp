// The two-level all-reduce (Design note [two-level all-reduce], comm/two_level.h).
#include "dtrain/comm/two_level.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "detail.h"
#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/reduce_scatter.h"

namespace dtrain::comm {

bool two_level_uses_workspace(const NodeGroups& nodes) {
  return nodes.two_level() && (reduce_scatter_uses_workspace(nodes.within) || all_gather_uses_workspace(nodes.within));
}

int64_t two_level_workspace_numel(const NodeGroups& nodes, int64_t numel) {
  const int64_t local = nodes.within.size();
  return local > 0 ? (numel + local - 1) / local * local : numel;
}

Work two_level_all_reduce(const ProcessGroup& pg, const NodeGroups& nodes, at::Tensor& tensor,
                          const AllReduceOptions& options, const at::Tensor& workspace) {
  if (!nodes.two_level()) return all_reduce(pg, tensor, options);
  const auto ctx = detail::context(pg, "two_level_all_reduce", tensor, to_string(options.op()));
  detail::check_tensor(ctx, tensor, "tensor");
  TORCH_CHECK(options.op() == ReduceOp::Sum || options.op() == ReduceOp::Avg, ctx, ": sums or averages only");
  at::NoGradGuard no_grad;
  const int local = nodes.within.size(), world = pg.size();
  const int64_t n = tensor.numel(), part = (n + local - 1) / local;
  // The tensor itself where it splits evenly, else a padded copy.
  const bool even = n == part * local;
  at::Tensor flat = even ? tensor.view({-1}) : at::zeros({part * local}, tensor.options());
  if (!even) flat.narrow(0, 0, n).copy_(tensor.view({-1}));
  at::Tensor ws;
  if (two_level_uses_workspace(nodes)) {
    ws = workspace.defined() ? detail::workspace_view(ctx, workspace, flat, part * local)
                             : at::empty({part * local}, tensor.options());
  }
  at::Tensor mine = flat.narrow(0, part * nodes.within.rank(), part);  // (in place: the note)
  Work first = reduce_scatter(nodes.within, mine, flat, ReduceScatterOptions().workspace(ws).async_op(true));
  const ProcessGroup within = nodes.within, across = nodes.across;
  const bool avg = options.op() == ReduceOp::Avg;
  // (the across and gather levels as stages: Work::advance starts each, wait() the rest)
  std::vector<std::function<Work()>> next;
  next.emplace_back([mine, across]() mutable { return all_reduce(across, mine, AllReduceOptions().async_op(true)); });
  next.emplace_back([flat, mine, ws, within, world, avg]() mutable {
    at::NoGradGuard no_grad;
    if (avg) mine.div_(world);
    return all_gather(within, flat, mine, AllGatherOptions().workspace(ws).async_op(true));
  });
  Work done = Work::staged(std::move(first), std::move(next), [tensor, flat, ws, even, n]() mutable {
    at::NoGradGuard no_grad;
    if (!even) tensor.view({-1}).copy_(flat.narrow(0, 0, n));
  });
  if (!options.async_op()) done.wait();
  return done;
}

}  // namespace dtrain::comm
