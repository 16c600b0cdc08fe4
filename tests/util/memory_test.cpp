// Counted CPU allocations (Design note [counted allocations], util/memory.h).
#include "dtrain/util/memory.h"
#include "dtrain/util/system.h"

#include <gtest/gtest.h>

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

// The memory planner's RSS figure (detail::RssPeak, Design note [memory plan]) rests on resetting
// the peak RSS: after reset_peak_rss() the peak is the RSS now, and pages touched after it raise it.
TEST(PeakRss, ResetStartsTheHighWaterMarkAtTheRssNow) {
  {
    std::vector<char> big(64 << 20, 1);  // 64 MiB touched, then freed (mmapped: back to the system)
    EXPECT_GT(big[12345], 0);
  }
  const double high = util::peak_rss_mib();
  if (!util::reset_peak_rss()) GTEST_SKIP() << "this kernel cannot reset the peak RSS (/proc/self/clear_refs)";
  const double now = util::current_rss_mib();
  const double reset = util::peak_rss_mib();
  EXPECT_LT(reset, high - 32) << "the peak RSS was not reset";
  EXPECT_NEAR(reset, now, 8.0);
  {
    std::vector<char> more(32 << 20, 1);
    EXPECT_GT(more[54321], 0);
    EXPECT_GE(util::peak_rss_mib(), reset + 28);
  }
}
