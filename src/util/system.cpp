#include "dtrain/util/system.h"

#include "dtrain/util/fs.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <malloc.h>

#include <algorithm>
#include <cstdlib>

#include <fstream>
#include <sstream>

#include <ATen/Parallel.h>
#ifdef DTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace dtrain::util {

namespace {
namespace fs = util::fs;
double status_field_mib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) {
      std::istringstream is(line.substr(prefix.size()));
      double kib = 0;
      is >> kib;
      return kib / 1024.0;
    }
  }
  return 0.0;
}
}  // namespace

double peak_rss_mib() { return status_field_mib("VmHWM"); }

bool fix_malloc_mmap_threshold(int64_t bytes) {
  if (bytes <= 0 || std::getenv("MALLOC_MMAP_THRESHOLD_") || allocator_in_use() != "glibc") return false;
#ifdef __GLIBC__
  return ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min<int64_t>(bytes, 1 << 30))) == 1;
#else
  return false;
#endif
}
double current_rss_mib() { return status_field_mib("VmRSS"); }

namespace {
// The preloaded allocators' own calls, where the process runs on one (dtrun --allocator): looked
// up at run time, so nothing links against them.
void release_preloaded_free_memory() {
  using Release = void (*)();  // gperftools' C API (malloc_extension_c.h)
  if (auto fn = reinterpret_cast<Release>(dlsym(RTLD_DEFAULT, "MallocExtension_ReleaseFreeMemory"))) fn();
  using Mallctl = int (*)(const char*, void*, size_t*, void*, size_t);  // jemalloc's
  if (auto fn = reinterpret_cast<Mallctl>(dlsym(RTLD_DEFAULT, "mallctl"))) {
    fn("arena.4096.purge", nullptr, nullptr, nullptr, 0);  // (4096: MALLCTL_ARENAS_ALL, every arena)
  }
}

int64_t preloaded_free_bytes() {
  using Property = int (*)(const char*, size_t*);  // gperftools' C API
  auto fn = reinterpret_cast<Property>(dlsym(RTLD_DEFAULT, "MallocExtension_GetNumericProperty"));
  size_t pageheap = 0, central = 0, transfer = 0, thread = 0;
  if (!fn || !fn("tcmalloc.pageheap_free_bytes", &pageheap)) return 0;
  fn("tcmalloc.central_cache_free_bytes", &central);
  fn("tcmalloc.transfer_cache_free_bytes", &transfer);
  fn("tcmalloc.thread_cache_free_bytes", &thread);
  return static_cast<int64_t>(pageheap + central + transfer + thread);
}
}  // namespace

bool trim_heap_and_reset_peak_rss() {
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
  release_preloaded_free_memory();
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

int64_t heap_free_bytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  return static_cast<int64_t>(::mallinfo2().fordblks) + preloaded_free_bytes();
#else
  return preloaded_free_bytes();
#endif
}

std::string allocator_in_use() {
  // (the library whose malloc the process calls: the first in the lookup order, a preload's)
  Dl_info info{};
  void* malloc_fn = dlsym(RTLD_DEFAULT, "malloc");
  const std::string lib = malloc_fn && dladdr(malloc_fn, &info) && info.dli_fname ? info.dli_fname : "";
  if (lib.find("tcmalloc") != std::string::npos) return "tcmalloc";
  if (lib.find("jemalloc") != std::string::npos) return "jemalloc";
  if (lib.find("libc.so") != std::string::npos || lib.empty()) return "glibc";
  return lib.substr(lib.find_last_of('/') + 1);  // (another one: its library's name)
}

std::string blas_name() {
  for (const char* link : {"/etc/alternatives/libblas.so.3-x86_64-linux-gnu", "/etc/alternatives/libblas.so.3"}) {
    auto target = fs::read_symlink(link);
    if (!target) continue;
    const std::string dir = fs::filename(fs::parent_path(*target));  // openblas-pthread, blas, ...
    if (dir == "blas") return "blas (reference, slow)";
    return dir;
  }
  return "unknown";
}

void set_threads(int threads) {
  at::set_num_threads(threads);
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) fn(threads);
}

int blas_threads() {
  using GetFn = int (*)();
  if (auto fn = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"))) return fn();
  return -1;
}

std::string device_name(const c10::Device& device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) return at::cuda::getDeviceProperties(device.has_index() ? device.index() : 0)->name;
#endif
  return device.str();
}

double peak_device_memory_mib(const c10::Device& device) {
#ifdef DTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.has_index() ? device.index() : 0);
    return static_cast<double>(stats.allocated_bytes[0].peak) / 1048576.0;  // [0]: StatType::AGGREGATE
  }
#endif
  (void)device;
  return -1.0;
}

double known_peak_tflops(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  // Most specific names first. Dense bf16/fp16 tensor-core peaks from NVIDIA's data sheets.
  if (has("GB200") || has("B200")) return 2250.0;
  if (has("H200")) return 989.4;
  if (has("H100") && (has("PCIe") || has("PCIE"))) return 756.5;
  if (has("H100") || has("H800")) return 989.4;
  if (has("A100") || has("A800")) return 312.0;
  if (has("L40S")) return 362.1;
  if (has("A10G")) return 70.0;
  if (has("L4")) return 121.0;
  return 0.0;
}

void lower_thread_priority(pid_t tid) {
  sched_param none{};
  if (::sched_setscheduler(tid, SCHED_IDLE, &none) == 0) return;
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19);
}

void lower_this_threads_priority() { lower_thread_priority(static_cast<pid_t>(::syscall(SYS_gettid))); }

}  // namespace dtrain::util
