#include "dtrain/ddp/bucket.h"

#include <map>

#include <c10/util/Exception.h>

namespace dtrain::ddp {

const char* to_string(BucketState s) {
  switch (s) {
    case BucketState::Waiting: return "Waiting";
    case BucketState::Ready: return "Ready";
    case BucketState::InFlight: return "InFlight";
    case BucketState::Reduced: return "Reduced";
  }
  return "?";
}

void Bucket::transition(BucketState from, BucketState to) {
  TORCH_INTERNAL_ASSERT(state == from, "bucket transition ", to_string(from), " -> ", to_string(to),
                        " attempted in state ", to_string(state));
  state = to;
}

int64_t Bucket::lay_out(size_t index, const std::vector<at::Tensor>& all_params,
                        std::vector<std::pair<size_t, size_t>>& where) {
  offsets.clear();
  int64_t offset = 0;
  for (size_t slot = 0; slot < params.size(); ++slot) {
    where[params[slot]] = {index, slot};
    offsets.push_back(offset);
    offset += all_params[params[slot]].numel();
  }
  return offset;
}

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params, int64_t cap_bytes,
                                                int64_t first_cap_bytes) {
  TORCH_CHECK(cap_bytes > 0 && first_cap_bytes > 0, "bucket caps must be positive");
  std::vector<std::vector<size_t>> buckets;
  struct Open {
    size_t bucket;
    int64_t bytes;
  };
  std::map<std::pair<int, std::string>, Open> open;  // (dtype, device) -> bucket being filled
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    const auto key = std::make_pair(static_cast<int>(p.scalar_type()), p.device().str());
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    auto it = open.find(key);
    const int64_t cap = buckets.empty() || (it != open.end() && it->second.bucket == 0) ? first_cap_bytes : cap_bytes;
    if (it == open.end() || (it->second.bytes > 0 && it->second.bytes + bytes > cap)) {
      buckets.emplace_back();
      it = open.insert_or_assign(key, Open{buckets.size() - 1, 0}).first;
    }
    buckets[it->second.bucket].push_back(k);
    it->second.bytes += bytes;
  }
  return buckets;
}

}  // namespace dtrain::ddp
