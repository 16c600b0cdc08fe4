#pragma once
// A gradient bucket: the parameters whose gradients are averaged together in one all-reduce.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/comm/work.h"

namespace dtrain::ddp {

enum class BucketState {
  Waiting,   // some of its parameters' gradients are still to come in this backward
  Ready,     // every gradient is in the flat buffer; waiting for earlier buckets to launch first
  InFlight,  // its all-reduce is running (overlapping the rest of backward)
  Reduced,   // averaged gradients written back; nothing to do until the next backward
};
const char* to_string(BucketState s);

struct Bucket {
  std::vector<size_t> params;    // indices into the reducer's parameter list
  std::vector<int64_t> offsets;  // element offset of each parameter in `buffer`
  at::Tensor buffer;             // flat, one dtype and device
  size_t pending = 0;            // gradients still to come in this backward
  comm::Work work;
  BucketState state = BucketState::Reduced;

  // Checked transition: throws (internal error) if the bucket is not in `from`.
  void transition(BucketState from, BucketState to);
  // Lays `params` (this bucket's, in order) out back to back: fills `offsets`, records
  // where[p] = {index, slot} for each, and returns the total number of elements.
  int64_t lay_out(size_t index, const std::vector<at::Tensor>& all_params,
                  std::vector<std::pair<size_t, size_t>>& where);
};

// Groups parameters into buckets the way PyTorch's DDP does: in reverse registration order (the
// order backward tends to produce gradients), split by dtype and device, each bucket at most
// `cap_bytes` (the first one at most `first_cap_bytes`, so communication starts early); a
// parameter larger than the cap gets a bucket of its own. Returns lists of parameter indices.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params, int64_t cap_bytes,
                                                int64_t first_cap_bytes);

}  // namespace dtrain::ddp
