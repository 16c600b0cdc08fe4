#include "dtrain/util/memory.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#if __has_include(<execinfo.h>)
#include <execinfo.h>
#include <unistd.h>
#define DTRAIN_HAS_BACKTRACE 1
#endif
#include <atomic>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#endif

#include <fstream>
#include <sstream>
#include <string>

#include "dtrain/compat.h"

namespace dtrain::util {
namespace {

struct Counts {
  std::mutex mu;
  std::unordered_map<void*, std::pair<size_t, c10::DeleterFnPtr>> live;  // data -> (bytes, base deleter)
  std::atomic<int64_t> bytes{0}, peak{0};
  std::array<std::atomic<int64_t>, 64> by_log2{};  // allocations counted by floor(log2(bytes))
};
Counts& counts() {
  static auto* c = new Counts();  // never destroyed: storages may be freed during static destruction
  return *c;
}

int log2_floor(size_t n) {
  int k = 0;
  while (n > 1) {
    n >>= 1;
    ++k;
  }
  return k;
}

void counted_delete(void* ptr) {
  Counts& c = counts();
  std::pair<size_t, c10::DeleterFnPtr> entry{0, nullptr};
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.live.find(ptr);
    if (it != c.live.end()) {
      entry = it->second;
      c.live.erase(it);
    }
  }
  c.bytes -= static_cast<int64_t>(entry.first);
  if (entry.second) entry.second(ptr);
}

// (Design note [counted allocations], util/memory.h)
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) DTRAIN_ALLOCATOR_CONST override {
    c10::DataPtr d = base_->allocate(n);
    void* data = d.get();
    if (!data || d.get_context() != data) return d;  // (not the CPU allocator's convention: not counted)
    Counts& c = counts();
    c10::DeleterFnPtr base_deleter = d.get_deleter();
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.live[data] = {n, base_deleter};
    }
    d.release_context();  // (ownership moves to the counted DataPtr below)
    c.by_log2[log2_floor(n)] += 1;
#ifdef DTRAIN_HAS_BACKTRACE
    static const long trace = std::getenv("DTRAIN_TRACE_ALLOC") ? std::atol(std::getenv("DTRAIN_TRACE_ALLOC")) : 0;
    if (trace > 0 && n >= size_t(trace)) {  // (Design note [counted allocations]: a debugging aid)
      void* frames[24];
      int k = ::backtrace(frames, 24);
      ::dprintf(2, "=== alloc %zu\n", n);
      ::backtrace_symbols_fd(frames, k, 2);
    }
#endif
    const int64_t now = c.bytes += static_cast<int64_t>(n);
    int64_t peak = c.peak.load();
    while (now > peak && !c.peak.compare_exchange_weak(peak, now)) {
    }
    return {data, data, &counted_delete, d.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
#if DTRAIN_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif

 private:
  c10::Allocator* base_;
};

}  // namespace

void count_cpu_allocations() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* a = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(a, /*priority=*/100);
  });
}

bool counting_cpu_allocations() { return dynamic_cast<CountingAllocator*>(c10::GetCPUAllocator()) != nullptr; }
int64_t cpu_live_bytes() { return counts().bytes.load(); }
int64_t cpu_peak_bytes() { return counts().peak.load(); }
void reset_cpu_peak_bytes() { counts().peak.store(counts().bytes.load()); }
int64_t cpu_allocations_of_at_least(int64_t bytes) {
  TORCH_CHECK(bytes > 0 && (bytes & (bytes - 1)) == 0, "cpu_allocations_of_at_least: ", bytes,
              " is not a power of two (allocations are counted by powers of two)");
  int64_t n = 0;
  for (size_t k = log2_floor(size_t(bytes)); k < counts().by_log2.size(); ++k) n += counts().by_log2[k].load();
  return n;
}

#ifdef DTRAIN_WITH_CUDA
namespace {
c10::DeviceIndex index_of(const c10::Device& d) { return d.has_index() ? d.index() : 0; }
}  // namespace
#endif

int64_t live_bytes(const c10::Device& device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device)).allocated_bytes[0].current;
#endif
  return device.is_cpu() ? cpu_live_bytes() : 0;
}

int64_t peak_bytes(const c10::Device& device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) return c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device)).allocated_bytes[0].peak;
#endif
  return device.is_cpu() ? cpu_peak_bytes() : 0;
}

void reset_peak_bytes(const c10::Device& device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
    return;
  }
#endif
  if (device.is_cpu()) reset_cpu_peak_bytes();
}

int64_t default_budget_bytes(const c10::Device& device, int local_ranks) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, index_of(device)) == cudaSuccess) return static_cast<int64_t>(prop.totalGlobalMem);
    return 0;
  }
#endif
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      int64_t kib = 0;
      fields >> kib;
      return kib * 1024 / std::max(local_ranks, 1);
    }
  }
  return 0;
}

}  // namespace dtrain::util
