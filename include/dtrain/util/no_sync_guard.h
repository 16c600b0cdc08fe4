#pragma once
// The guard every data-parallel wrapper's no_sync() returns (DDP, ZeRO-2, FSDP): while it lives,
// the wrapper's "synchronize gradients" flag is off; it restores the previous value when it dies.
#include <utility>

namespace dtrain::util {

class NoSyncGuard {
 public:
  explicit NoSyncGuard(bool* sync) : sync_(sync), before_(*sync) { *sync_ = false; }
  NoSyncGuard(NoSyncGuard&& o) noexcept : sync_(std::exchange(o.sync_, nullptr)), before_(o.before_) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (sync_) *sync_ = before_;
  }

 private:
  bool* sync_;
  bool before_;
};

}  // namespace dtrain::util
