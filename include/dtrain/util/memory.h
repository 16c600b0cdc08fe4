#pragma once
// Counted CPU allocations: how many bytes of tensor storage are live now, and the most that were
// live at once, in this process (the CPU's torch.cuda.memory_allocated / max_memory_allocated).
//
// Design note [counted allocations]
// libtorch keeps no count of CPU tensor memory, and RSS is a poor stand-in (glibc keeps freed pages,
// the libraries' code and Gloo's buffers are in it). count_cpu_allocations() puts a counting
// allocator over libtorch's CPU allocator (c10::SetCPUAllocator): every CPU tensor storage allocated
// after it is counted until its storage is freed. Its DataPtr keeps the base allocator's convention
// (context == data, one static deleter), so raw_allocate/raw_deleter still work; the deleter finds
// the size in a map from pointer to (bytes, the base's deleter) under a mutex, which is cheap next to
// the allocation itself. Storages allocated before it are freed by the base allocator directly and
// never counted. The memory planner (train/planner.h) measures activations and checks its
// predictions with it. For debugging, DTRAIN_TRACE_ALLOC=BYTES prints a backtrace (to stderr) of
// every counted allocation of at least BYTES: how the buffers of Design note [buffers reused]
// (util/block_pool.h) were found.
#include <cstdint>

#include <c10/core/Device.h>

namespace dtrain::util {

// Installs the counting allocator (idempotent, thread-safe). Counting starts now.
void count_cpu_allocations();
bool counting_cpu_allocations();
// Bytes of CPU tensor storage allocated since count_cpu_allocations() and not yet freed.
int64_t cpu_live_bytes();
// The most cpu_live_bytes() has been since the counting started or the last reset.
int64_t cpu_peak_bytes();
// Sets the peak to the live bytes now (to measure the peak of a phase).
void reset_cpu_peak_bytes();
// How many CPU tensor storages of at least `bytes` (a power of two) were allocated since
// count_cpu_allocations(): the difference over a step is what it allocated anew (Design note
// [buffers reused]).
int64_t cpu_allocations_of_at_least(int64_t bytes);

// The same for any device: the counts above for the CPU (0 unless counting), the CUDA caching
// allocator's allocated bytes (torch.cuda.memory_allocated / max_memory_allocated /
// reset_peak_memory_stats) for a GPU.
int64_t live_bytes(const c10::Device& device);
int64_t peak_bytes(const c10::Device& device);
void reset_peak_bytes(const c10::Device& device);
// Memory a rank on `device` may plan with when no budget is given: the GPU's total memory, or on the
// CPU MemAvailable (/proc/meminfo) shared by the local ranks (`local_ranks`); 0 when unknown.
int64_t default_budget_bytes(const c10::Device& device, int local_ranks);

}  // namespace dtrain::util
