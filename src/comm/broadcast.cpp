#include "dtrain/comm/broadcast.h"

#include <map>

#include "detail.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::comm {

Work broadcast(const ProcessGroup& pg, at::Tensor& tensor, const BroadcastOptions& options) {
  const auto ctx = detail::context(pg, "broadcast", tensor, "src " + std::to_string(options.src()));
  detail::check_tensor(ctx, tensor);
  TORCH_CHECK(options.src() >= 0 && options.src() < pg.size(), ctx, ": src ", options.src(),
              " is outside the group [0, ", pg.size(), ")");
  detail::verify_same_call(pg, ctx, 2,
                           {options.src(), static_cast<int64_t>(tensor.scalar_type()), tensor.numel()});
  if (pg.size() == 1) return Work();
  c10d::BroadcastOptions opts;
  opts.rootRank = options.src();
  std::vector<at::Tensor> tensors{detail::as_wire(pg, tensor)};
  detail::count_traffic(detail::TrafficKind::Broadcast, static_cast<int64_t>(tensor.nbytes()), pg);
  return detail::launch(pg, ctx, [&] { return pg.backend().broadcast(tensors, opts); }, nullptr,
                        options.async_op());
}

void broadcast_coalesced(const ProcessGroup& pg, std::vector<at::Tensor> tensors, int src,
                         int64_t bucket_bytes, at::Tensor* scratch) {
  if (pg.size() == 1) return;
  // Bucket by (dtype, device) in order of appearance, each bucket at most bucket_bytes
  // (a single larger tensor gets a bucket of its own).
  std::vector<std::vector<at::Tensor>> buckets;
  std::map<std::pair<int, std::string>, size_t> open;  // (dtype, device) -> open bucket index
  std::vector<int64_t> bucket_size;
  for (auto& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    auto key = std::make_pair(static_cast<int>(t.scalar_type()), t.device().str());
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    auto it = open.find(key);
    if (it == open.end() || bucket_size[it->second] + bytes > bucket_bytes) {
      buckets.emplace_back();
      bucket_size.push_back(0);
      open[key] = buckets.size() - 1;
      it = open.find(key);
    }
    buckets[it->second].push_back(t);
    bucket_size[it->second] += bytes;
  }
  for (auto& bucket : buckets) {
    std::vector<at::Tensor> flat_parts;
    for (auto& t : bucket) flat_parts.push_back(t.reshape({-1}));
    at::Tensor flat;
    int64_t numel = 0;
    for (const auto& t : flat_parts) numel += t.numel();
    const auto& first = bucket.front();
    if (scratch && scratch->defined() && scratch->scalar_type() == first.scalar_type() &&
        scratch->device() == first.device() && scratch->numel() >= numel) {
      flat = scratch->narrow(0, 0, numel);
      at::cat_out(flat, flat_parts);
    } else {
      flat = at::cat(flat_parts);
      if (scratch && (!scratch->defined() || scratch->numel() < numel)) *scratch = flat;
    }
    broadcast(pg, flat, BroadcastOptions().src(src));
    int64_t offset = 0;
    at::NoGradGuard no_grad;
    for (auto& t : bucket) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace dtrain::comm
