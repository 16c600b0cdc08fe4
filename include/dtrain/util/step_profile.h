#pragma once
// A kernel-level profile of a few training steps, for comparing dtrain with PyTorch on a GPU
// (bench/gpu_bench.py --profile). Developer tool, set by the environment so no flag of the loop
// changes: DTRAIN_PROFILE=PATH[@FIRST:LAST] profiles steps FIRST..LAST (1-based; default 3:4) with
// libtorch's profiler (Kineto: CPU operators and, on CUDA, every kernel and copy) and writes, on
// rank 0 only, one JSON object to PATH:
//   {"steps": 2, "events": [{"name": ..., "device": "cuda"|"cpu", "count": n, "total_us": t}, ...]}
// summed by name and device, largest total first (bench/profile_summary.py writes the same from a
// PyTorch trace). A profiler that fails to start or stop prints a warning; training goes on.
#include <cstdint>
#include <string>

namespace dtrain::util {

class StepProfile {
 public:
  // From DTRAIN_PROFILE (unset or empty: off). `rank`: only rank 0 writes.
  static StepProfile from_environment(int rank);
  StepProfile() = default;
  bool enabled() const { return !path_.empty(); }
  void begin_step(int64_t step);  // 1-based
  void end_step(int64_t step);    // after the step's work is queued (and its loss read)

 private:
  std::string path_;
  int64_t first_ = 3, last_ = 4;
  bool active_ = false, write_ = false;
};

}  // namespace dtrain::util
