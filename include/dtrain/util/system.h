#pragma once
// Facts about the running process and machine that benchmarks and the demo report.
#include <sys/types.h>

#include <string>

#include <c10/core/Device.h>

namespace dtrain::util {

// Peak resident set size of this process (VmHWM), in MiB; 0 where /proc is unavailable.
double peak_rss_mib();
// Current resident set size (VmRSS), in MiB.
double current_rss_mib();
// Returns the heap's free pages to the system (glibc malloc_trim; a preloaded tcmalloc's or
// jemalloc's own release) and resets the peak RSS (VmHWM) to the RSS now (Linux >= 4.0:
// /proc/self/clear_refs "5"). false where it could not.
bool trim_heap_and_reset_peak_rss();
// Bytes the C heap holds free for reuse (glibc's mallinfo2 fordblks, every arena, plus a preloaded
// tcmalloc's free bytes): resident but not in use. 0 where unknown.
int64_t heap_free_bytes();
// The memory allocator this process runs on: the library its malloc comes from ("tcmalloc" or
// "jemalloc": dtrun --allocator preloads one, Design note [the workers' allocator],
// launch/allocator.h; "glibc"; or another library's file name).
std::string allocator_in_use();
// Which BLAS libtorch's matrix products go through: the target of Debian's libblas.so.3
// alternative (e.g. "openblas-pthread", "blas (reference)"), or "unknown".
std::string blas_name();

// Sets the intra-op threads of libtorch (at::set_num_threads) and of the BLAS behind it: the
// pthread build of OpenBLAS keeps its own pool (sized to all cores, spinning on sched_yield)
// that at::set_num_threads does not touch, so ranks sharing a machine would oversubscribe it.
void set_threads(int threads);
// The BLAS library's own thread count where it tells (OpenBLAS), else -1.
int blas_threads();

// Fixes glibc's mmap threshold at `bytes` (mallopt M_MMAP_THRESHOLD; see Design note [freed
// memory] in fsdp/fully_sharded_data_parallel.h) unless MALLOC_MMAP_THRESHOLD_ is set or bytes is
// 0 or the process runs on another allocator. Returns whether it changed anything.
bool fix_malloc_mmap_threshold(int64_t bytes);

// The device's name: the GPU's ("NVIDIA H100 80GB HBM3") for a CUDA device, "cpu" otherwise.
std::string device_name(const c10::Device& device);
// The calling thread yields the cores to training where they are scarce (a background writer or
// sender): Linux's SCHED_IDLE class for this thread (it runs when a core has nothing else to run;
// a nice value of 19 still takes 1.5% of a busy core and preempts at wake-up), or nice 19 where
// the class is refused. Its work takes longer, the steps do not.
void lower_this_threads_priority();
// The same for thread `tid` of this process (a thread that ended is skipped).
void lower_thread_priority(pid_t tid);
// The most memory the CUDA caching allocator has handed out on `device` at once since the process
// started (PyTorch's torch.cuda.max_memory_allocated), in MiB; -1 for a CPU device or a libtorch
// without CUDA.
double peak_device_memory_mib(const c10::Device& device);
// Dense 16-bit (bf16/fp16) tensor-core peak of a GPU known by its name, in TFLOP/s (the vendor's
// figure without sparsity: H100/H200 SXM 989, H100 PCIe 756, A100 312, ...); 0 when not known.
double known_peak_tflops(const std::string& device_name);

}  // namespace dtrain::util
