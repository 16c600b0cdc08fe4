#include "dtrain/amp/autocast.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include "dtrain/compat.h"

namespace dtrain::amp {

AutocastState AutocastState::current(c10::DeviceType device) {
  return {compat::autocast_enabled(device), compat::autocast_dtype(device)};
}

void AutocastState::apply(c10::DeviceType device) const {
  compat::set_autocast_enabled(device, enabled);
  compat::set_autocast_dtype(device, dtype);
}

AutocastGuard::AutocastGuard(c10::DeviceType device, at::ScalarType dtype, bool enabled)
    : AutocastGuard(device, AutocastState{enabled, dtype}) {}

AutocastGuard::AutocastGuard(c10::DeviceType device, AutocastState state)
    : device_(device), previous_(AutocastState::current(device)) {
  TORCH_CHECK(device == c10::kCPU || device == c10::kCUDA, "AutocastGuard: autocast is for CPU or CUDA, not ", device);
  TORCH_CHECK(!state.enabled || state.dtype == at::kBFloat16 || (device == c10::kCUDA && state.dtype == at::kHalf),
              "AutocastGuard: use bf16 (CPU or CUDA) or fp16 (CUDA only), not ", state.dtype, " on ", device);
  state.apply(device);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // Leaving the outermost region drops the cache of low-precision weight copies.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  previous_.apply(device_);
}

}  // namespace dtrain::amp
