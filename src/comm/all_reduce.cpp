#include "dtrain/comm/all_reduce.h"

#include "detail.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::comm {

Work all_reduce(const ProcessGroup& pg, at::Tensor& tensor, const AllReduceOptions& options) {
  const auto ctx = detail::context(pg, "all_reduce", tensor, to_string(options.op()));
  detail::check_tensor(ctx, tensor);
  TORCH_CHECK(options.op() != ReduceOp::Avg || at::isFloatingType(tensor.scalar_type()), ctx,
              ": avg needs a floating-point tensor");
  detail::verify_same_call(pg, ctx, 1,
                           {static_cast<int64_t>(options.op()),
                            static_cast<int64_t>(tensor.scalar_type()), tensor.numel()});
  if (pg.size() == 1) return Work();
  c10d::AllreduceOptions opts;
  opts.reduceOp = detail::to_c10d(options.op());
  const int world = pg.size();
  const bool avg = options.op() == ReduceOp::Avg;
  std::vector<at::Tensor> tensors{tensor};
  std::function<void()> then;
  if (pg.backend_kind() == BackendKind::Gloo && !detail::gloo_supports(tensor.scalar_type())) {
    // libtorch 1.13's Gloo cannot reduce bf16 (or bool, int16): reduce in float32 and round back.
    // (The flat reduce_scatter keeps bf16 on the wire; see reduce_scatter.cpp.)
    TORCH_CHECK(at::isFloatingType(tensor.scalar_type()), ctx, ": Gloo cannot reduce ",
                tensor.scalar_type(), " tensors");
    at::Tensor wide = tensor.to(at::kFloat);
    tensors = {wide};
    then = [tensor, wide, world, avg]() mutable {
      if (avg) wide.div_(world);
      tensor.copy_(wide);
    };
  } else if (avg) {
    then = [tensor, world]() mutable { tensor.div_(world); };
  }
  // (the bytes that travel: the float32 copy where Gloo cannot reduce the dtype)
  detail::count_traffic(detail::TrafficKind::AllReduce, static_cast<int64_t>(tensors.front().nbytes()), pg);
  return detail::launch(pg, ctx, [&] { return pg.backend().allreduce(tensors, opts); }, std::move(then),
                        options.async_op());
}

bool reduces_natively(const ProcessGroup& pg, at::ScalarType dtype) {
  return pg.backend_kind() != BackendKind::Gloo || detail::gloo_supports(dtype);
}

}  // namespace dtrain::comm
