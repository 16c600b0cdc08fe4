#pragma once
// dtrun --bind-cores on|off|auto: each local worker pinned to its own cores.
//
// Design note [ranks bound to cores]
// ----------------------------------
// Ranks of one node that share every core let the scheduler move their threads between cores
// (caches lost, a rank's intra-op threads preempted by another rank's), and each rank's BLAS and
// OpenMP pools assume cores they do not have alone. As torch.backends.xeon.run_cpu does, dtrun
// splits the cores it may use (its own affinity), ordered by physical core so that a core's
// hardware threads stay together, into one contiguous run per local rank, within a NUMA node where
// the nodes' cores divide evenly among the ranks, sets each worker's affinity
// before it starts, and its OMP_NUM_THREADS to its cores (unless set: the user's wins). The
// cores left over when the ranks do not divide them are given to none (the workers' Gloo and
// I/O threads run on the rank's own cores). auto binds when every rank gets at least one core;
// off leaves placement to the OS.
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::launch {

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}; throws std::invalid_argument on a malformed list.
std::vector<int> parse_cpu_list(const std::string& list);
// This process's allowed cores (sched_getaffinity), ascending.
std::vector<int> allowed_cores();
// The machine's NUMA nodes' cores (/sys/devices/system/node/node<N>/cpulist, by N), each
// ascending; empty where the machine reports none.
std::vector<std::vector<int>> numa_nodes();
// (package, core) of a CPU (/sys/devices/system/cpu/cpu<N>/topology): the hardware threads of one
// physical core share it; (0, cpu) where the machine does not say.
std::pair<int, int> physical_core_of(int cpu);
// `cpus` ordered by physical core (its hardware threads next to each other: on most x86 machines
// the second thread of every core has a high number, so a split by number would give two ranks
// the two threads of the same cores).
std::vector<int> by_physical_core(const std::vector<int>& cpus, const std::function<std::pair<int, int>(int)>& core_of);
// `cores` (in that order: by_physical_core's) split among `ranks` local ranks (Design note [ranks
// bound to cores]): equal contiguous runs, within the NUMA nodes of `nodes` where each node has as
// many of `cores` and they divide among its ranks; each run ascending; empty when a rank would get
// none.
std::vector<std::vector<int>> split_cores(const std::vector<int>& cores, int ranks, const std::vector<std::vector<int>>& nodes);
// "0-3" / "0,2,4": a run of cores as a list.
std::string cpu_list(const std::vector<int>& cores);

}  // namespace dtrain::launch
