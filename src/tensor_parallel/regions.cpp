#include "dtrain/tensor_parallel/regions.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/reduce_scatter.h"

namespace dtrain::tensor_parallel {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels with the autograd context (saved_data holds IValues: a capsule of this).
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(comm::ProcessGroup g) : pg(std::move(g)) {}
  comm::ProcessGroup pg;
};
void keep(AutogradContext* ctx, const comm::ProcessGroup& tp, int64_t dim) {
  ctx->saved_data["pg"] = at::IValue::make_capsule(c10::make_intrusive<GroupHolder>(tp));
  ctx->saved_data["dim"] = dim;
}
const comm::ProcessGroup& group(AutogradContext* ctx) {
  return static_cast<GroupHolder*>(ctx->saved_data["pg"].toCapsule().get())->pg;
}
int64_t dim_of(AutogradContext* ctx) { return ctx->saved_data["dim"].toInt(); }

int64_t wrap(const at::Tensor& x, int64_t dim) { return dim < 0 ? dim + x.dim() : dim; }

at::Tensor all_reduced(const at::Tensor& x, const comm::ProcessGroup& tp) {
  at::Tensor out = x.detach().clone(at::MemoryFormat::Contiguous);
  if (tp.size() > 1) comm::all_reduce(tp, out);
  return out;
}

at::Tensor reduce_scattered(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  const int64_t d = wrap(x, dim);
  const int64_t n = tp.size();
  TORCH_CHECK(x.size(d) % n == 0, "tensor parallel (rank ", tp.rank(), "): size ", x.size(d), " along dim ", d,
              " does not divide by the ", n, " ranks of the tensor-parallel group");
  if (n == 1) return x.detach().clone();
  // Rank r's slice along d, laid end to end: [n, ...] with the slices outermost.
  auto sizes = x.sizes().vec();
  sizes[d] /= n;
  at::Tensor parts = at::stack(x.detach().chunk(n, d)).contiguous();  // [n, sizes...]
  at::Tensor out = at::empty(sizes, x.options());
  at::Tensor flat_out = out.view({-1});
  comm::reduce_scatter(tp, flat_out, parts.view({-1}));
  return out;
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::ProcessGroup& tp) {
    keep(ctx, tp, 0);
    return x;  // (an input returned as it is: autograd makes it a view and routes its gradient here)
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_reduced(g[0], group(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::ProcessGroup& tp) {
    keep(ctx, tp, 0);
    return all_reduced(x, tp);
  }
  static variable_list backward(AutogradContext*, variable_list g) { return {g[0], at::Tensor()}; }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
    keep(ctx, tp, dim);
    return all_gather_along(x, tp, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {slice_along(g[0], group(ctx), dim_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
    keep(ctx, tp, dim);
    return slice_along(x, tp, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_along(g[0], group(ctx), dim_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
    keep(ctx, tp, dim);
    return all_gather_along(x, tp, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {reduce_scattered(g[0], group(ctx), dim_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
    keep(ctx, tp, dim);
    return reduce_scattered(x, tp, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {all_gather_along(g[0], group(ctx), dim_of(ctx)), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor all_gather_along(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  const int64_t d = wrap(x, dim);
  const int64_t n = tp.size();
  if (n == 1) return x.detach().clone();
  at::Tensor flat = at::empty({n * x.numel()}, x.options());
  comm::all_gather(tp, flat, x.detach().contiguous().view({-1}));
  // [n, sizes...] -> concatenated along d
  auto sizes = x.sizes().vec();
  sizes.insert(sizes.begin(), n);
  return at::cat(flat.view(sizes).unbind(0), d);
}

at::Tensor slice_along(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  const int64_t d = wrap(x, dim);
  const int64_t n = tp.size();
  TORCH_CHECK(x.size(d) % n == 0, "tensor parallel (rank ", tp.rank(), "): size ", x.size(d), " along dim ", d,
              " does not divide by the ", n, " ranks of the tensor-parallel group");
  return x.detach().chunk(n, d)[tp.rank()].contiguous();
}

at::Tensor rows_piece(const at::Tensor& full, const comm::ProcessGroup& tp, int64_t stride) {
  TORCH_CHECK(full.dim() >= 1 && full.size(0) % stride == 0, "tensor parallel: ", full.size(0),
              " rows do not divide into ", stride, " blocks");
  auto shape = full.sizes().vec();
  shape[0] /= tp.size();
  return slice_along(full.detach().reshape({stride, full.size(0) / stride, -1}), tp, 1).reshape(shape);
}

at::Tensor rows_full(const at::Tensor& piece, const comm::ProcessGroup& tp, int64_t stride) {
  auto shape = piece.sizes().vec();
  shape[0] *= tp.size();
  return all_gather_along(piece.detach().reshape({stride, piece.size(0) / stride, -1}), tp, 1).reshape(shape);
}

at::Tensor copy_to_region(const at::Tensor& x, const comm::ProcessGroup& tp) { return CopyToRegion::apply(x, tp); }
at::Tensor reduce_from_region(const at::Tensor& x, const comm::ProcessGroup& tp) { return ReduceFromRegion::apply(x, tp); }
at::Tensor gather_from_region(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  return GatherFromRegion::apply(x, tp, dim);
}
at::Tensor scatter_to_region(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  return ScatterToRegion::apply(x, tp, dim);
}
at::Tensor gather_sequence(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  return GatherSequence::apply(x, tp, dim);
}
at::Tensor reduce_scatter_sequence(const at::Tensor& x, const comm::ProcessGroup& tp, int64_t dim) {
  return ReduceScatterSequence::apply(x, tp, dim);
}

}  // namespace dtrain::tensor_parallel
