// Counted CPU allocations (Design note [counted allocations], util/memory.h) and the peak RSS
// reset the memory planner measures with (util/system.h).
#include "dtrain/util/memory.h"
#include "dtrain/util/system.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

using namespace dtrain;

TEST(CountedAllocations, LiveAndPeakFollowTensors) {
  util::count_cpu_allocations();
  util::count_cpu_allocations();  // (idempotent)
  ASSERT_TRUE(util::counting_cpu_allocations());
  const int64_t before = util::cpu_live_bytes();
  util::reset_cpu_peak_bytes();
  {
    at::Tensor a = at::empty({1000}, at::kFloat);        // 4000 bytes
    at::Tensor b = at::empty({10, 100}, at::kDouble);    // 8000 bytes
    EXPECT_EQ(util::cpu_live_bytes() - before, 12000);
    at::Tensor view = b.narrow(0, 0, 5);                 // a view allocates nothing
    EXPECT_EQ(util::cpu_live_bytes() - before, 12000);
    a = at::Tensor();
    EXPECT_EQ(util::cpu_live_bytes() - before, 8000);
  }
  EXPECT_EQ(util::cpu_live_bytes(), before);
  EXPECT_EQ(util::cpu_peak_bytes() - before, 12000);
  util::reset_cpu_peak_bytes();
  EXPECT_EQ(util::cpu_peak_bytes(), util::cpu_live_bytes());
  EXPECT_EQ(util::peak_bytes(c10::Device(c10::kCPU)), util::cpu_peak_bytes());
}

TEST(CountedAllocations, RawAllocationsAndOtherThreadsAreCounted) {
  util::count_cpu_allocations();
  const int64_t before = util::cpu_live_bytes();
  c10::Allocator* alloc = c10::GetCPUAllocator();
  void* p = alloc->raw_allocate(4096);  // (needs context == data: the counting allocator keeps it)
  EXPECT_EQ(util::cpu_live_bytes() - before, 4096);
  alloc->raw_deallocate(p);
  EXPECT_EQ(util::cpu_live_bytes(), before);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 200; ++i) at::Tensor x = at::ones({256 + i});
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(util::cpu_live_bytes(), before);
}

TEST(CountedAllocations, OperationsAllocateWhatTheyReturn) {
  util::count_cpu_allocations();
  at::Tensor x = at::randn({64, 64});
  util::reset_cpu_peak_bytes();
  const int64_t before = util::cpu_live_bytes();
  at::Tensor y = x.matmul(x);
  EXPECT_GE(util::cpu_live_bytes() - before, 64 * 64 * 4);
  EXPECT_GE(util::cpu_peak_bytes() - before, 64 * 64 * 4);
}

// The memory planner's RSS figure (detail::RssPeak, Design note [memory plan] in train/planner.h) rests on resetting
// the peak RSS: after trim_heap_and_reset_peak_rss() the peak is the RSS now, and pages touched after it raise it.
namespace {
// Touches `mib` MiB (every page written through a volatile pointer, so no compiler drops it), then frees them.
void touch_mib(int mib) {
  const size_t n = static_cast<size_t>(mib) << 20;
  auto* p = static_cast<volatile char*>(std::malloc(n));  // (above glibc's mmap threshold: unmapped when freed)
  ASSERT_NE(p, nullptr);
  for (size_t i = 0; i < n; i += 4096) p[i] = 1;
  std::free(const_cast<char*>(p));
}
}  // namespace

TEST(PeakRss, ResetStartsTheHighWaterMarkAtTheRssNow) {
  touch_mib(64);
  const double high = util::peak_rss_mib();
  if (!util::trim_heap_and_reset_peak_rss()) GTEST_SKIP() << "this kernel cannot reset the peak RSS (/proc/self/clear_refs)";
  const double now = util::current_rss_mib();
  const double reset = util::peak_rss_mib();
  EXPECT_LT(reset, high - 32) << "the peak RSS was not reset";
  EXPECT_NEAR(reset, now, 8.0);
  touch_mib(32);
  EXPECT_GE(util::peak_rss_mib(), reset + 28);
}
