#pragma once
// Autocast regions, as torch.autocast: inside, eligible ops (matrix products, ...) run in the
// lower precision (bf16 on CPU and CUDA, fp16 on CUDA) while precision-sensitive ones stay fp32.
//
//   { dtrain::amp::AutocastGuard guard(c10::kCPU, at::kBFloat16); loss = model->forward(x); }
#include <ATen/core/ATen_fwd.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace dtrain::amp {

// The autocast settings of one device type (what a region saves and restores).
struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
  static AutocastState current(c10::DeviceType device);
  void apply(c10::DeviceType device) const;
};

class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, at::ScalarType dtype, bool enabled = true);
  AutocastGuard(c10::DeviceType device, AutocastState state);
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  ~AutocastGuard();

 private:
  c10::DeviceType device_;
  AutocastState previous_;
};

}  // namespace dtrain::amp
