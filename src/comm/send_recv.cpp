#include "dtrain/comm/send_recv.h"

#include "detail.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::comm {

namespace {

// Gloo's send and recv hand the tensor's pointer to its TCP transport as host memory: a CUDA tensor
// travels through a host copy (Design note [ranks sharing a GPU], train/session.cpp). Its
// collectives stage CUDA tensors themselves.
bool staged(const ProcessGroup& pg, const at::Tensor& t) {
  return pg.backend_kind() == BackendKind::Gloo && t.is_cuda();
}

// Gloo's send and receive works learn of their completion only in a blocking wait (Design note
// [aborting a group's waits], abort.h): they block, armed or not, and the group's abort signal
// ends them through their abort(). (A peer that died closes its sockets, which ends the wait
// with an error.)
bool interrupted(const ProcessGroup& pg) { return pg.backend_kind() == BackendKind::Gloo; }

}  // namespace

Work send(const ProcessGroup& pg, const at::Tensor& tensor, int dst, const SendRecvOptions& options) {
  const auto ctx = detail::context(pg, "send", tensor, "to " + std::to_string(dst) + ", tag " +
                                                           std::to_string(options.tag()));
  detail::check_tensor(ctx, tensor);
  TORCH_CHECK(dst >= 0 && dst < pg.size() && dst != pg.rank(), ctx, ": dst ", dst,
              " must be another rank of the group [0, ", pg.size(), ")");
  const at::Tensor host = staged(pg, tensor) ? tensor.cpu() : tensor;
  std::vector<at::Tensor> tensors{detail::as_wire(pg, host)};
  detail::count_traffic(detail::TrafficKind::Send, static_cast<int64_t>(tensor.nbytes()), pg, dst);
  std::function<void()> keep;
  if (staged(pg, tensor)) keep = [host] {};  // the host copy lives until the send completes
  return detail::launch(pg, ctx, [&] { return pg.backend().send(tensors, dst, options.tag()); }, std::move(keep),
                        options.async_op(), /*interrupt=*/interrupted(pg));
}

Work recv(const ProcessGroup& pg, at::Tensor& tensor, int src, const SendRecvOptions& options) {
  const auto ctx = detail::context(pg, "recv", tensor, "from " + std::to_string(src) + ", tag " +
                                                           std::to_string(options.tag()));
  detail::check_tensor(ctx, tensor);
  TORCH_CHECK(src >= -1 && src < pg.size() && src != pg.rank(), ctx, ": src ", src,
              " must be another rank of the group [0, ", pg.size(), ") or -1 for any");
  const at::Tensor host = staged(pg, tensor) ? at::empty_like(tensor, tensor.options().device(at::kCPU)) : tensor;
  std::vector<at::Tensor> tensors{detail::as_wire(pg, host)};
  detail::count_traffic(detail::TrafficKind::Recv, static_cast<int64_t>(tensor.nbytes()), pg);
  std::function<void()> then;
  if (staged(pg, tensor)) then = [host, out = tensor]() mutable { out.copy_(host); };
  if (src < 0) {
    return detail::launch(pg, ctx, [&] { return pg.backend().recvAnysource(tensors, options.tag()); }, std::move(then),
                          options.async_op(), /*interrupt=*/interrupted(pg));
  }
  return detail::launch(pg, ctx, [&] { return pg.backend().recv(tensors, src, options.tag()); }, std::move(then),
                        options.async_op(), /*interrupt=*/interrupted(pg));
}

}  // namespace dtrain::comm
