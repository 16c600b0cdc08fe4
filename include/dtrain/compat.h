#pragma once
// The one place where libtorch 1.13 and 2.x differ for dtrain.
//
// - 1.13: c10d::ProcessGroupGloo / ProcessGroupNCCL derive from c10d::ProcessGroup and are used
//   directly. 2.x: they derive from c10d::Backend (c10d::ProcessGroup became a dispatching
//   wrapper). dtrain talks to the backend object, so `compat::Backend` names that base class.
// - 1.13's Gloo lacks _allgather_base, _reduce_scatter_base and reduce_scatter: see
//   comm/all_gather.cpp and comm/reduce_scatter.cpp for how those are filled.
// - Autocast state: 1.13-2.3 have per-device functions (set_cpu_enabled, set_enabled for CUDA,
//   set_autocast_cpu_dtype, ...); 2.4+ take the device type. compat::autocast_* hide that.
// - Optimizer::zero_grad's default changed (set_to_none = true in 2.x): dtrain never relies on it.

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif
#include <ATen/autocast_mode.h>

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
inline constexpr bool kTorch2 = true;
#else
using Backend = c10d::ProcessGroup;
inline constexpr bool kTorch2 = false;
#endif

using Work = c10d::Work;

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline void set_autocast_enabled(c10::DeviceType d, bool on) { at::autocast::set_autocast_enabled(d, on); }
inline at::ScalarType autocast_dtype(c10::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) { at::autocast::set_autocast_dtype(d, t); }
#else
inline bool autocast_enabled(c10::DeviceType d) {
  return d == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
inline void set_autocast_enabled(c10::DeviceType d, bool on) {
  if (d == c10::kCUDA) {
    at::autocast::set_enabled(on);
  } else {
    at::autocast::set_cpu_enabled(on);
  }
}
inline at::ScalarType autocast_dtype(c10::DeviceType d) {
  return d == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) {
  if (d == c10::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(t);
  } else {
    at::autocast::set_autocast_cpu_dtype(t);
  }
}
#endif
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

}  // namespace dtrain::compat
