#include "dtrain/comm/send_recv.h"

#include "detail.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::comm {

Work send(const ProcessGroup& pg, const at::Tensor& tensor, int dst, const SendRecvOptions& options) {
  const auto ctx = detail::context(pg, "send", tensor, "to " + std::to_string(dst) + ", tag " +
                                                           std::to_string(options.tag()));
  detail::check_tensor(ctx, tensor);
  TORCH_CHECK(dst >= 0 && dst < pg.size() && dst != pg.rank(), ctx, ": dst ", dst,
              " must be another rank of the group [0, ", pg.size(), ")");
  std::vector<at::Tensor> tensors{detail::as_wire(pg, tensor)};
  detail::count_traffic(detail::TrafficKind::Send, static_cast<int64_t>(tensor.nbytes()), pg.size());
  return detail::launch(pg, ctx, [&] { return pg.backend().send(tensors, dst, options.tag()); }, nullptr,
                        options.async_op());
}

Work recv(const ProcessGroup& pg, at::Tensor& tensor, int src, const SendRecvOptions& options) {
  const auto ctx = detail::context(pg, "recv", tensor, "from " + std::to_string(src) + ", tag " +
                                                           std::to_string(options.tag()));
  detail::check_tensor(ctx, tensor);
  TORCH_CHECK(src < pg.size() && src != pg.rank(), ctx, ": src ", src,
              " must be another rank of the group [0, ", pg.size(), ") or -1 for any");
  std::vector<at::Tensor> tensors{detail::as_wire(pg, tensor)};
  detail::count_traffic(detail::TrafficKind::Recv, static_cast<int64_t>(tensor.nbytes()), pg.size());
  if (src < 0) {
    return detail::launch(pg, ctx, [&] { return pg.backend().recvAnysource(tensors, options.tag()); }, nullptr,
                          options.async_op());
  }
  return detail::launch(pg, ctx, [&] { return pg.backend().recv(tensors, src, options.tag()); }, nullptr,
                        options.async_op());
}

}  // namespace dtrain::comm
