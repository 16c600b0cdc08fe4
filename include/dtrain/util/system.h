#pragma once
// Facts about the running process and machine that benchmarks and the demo report.
#include <string>

namespace dtrain::util {

// Peak resident set size of this process (VmHWM), in MiB; 0 where /proc is unavailable.
double peak_rss_mib();
// Current resident set size (VmRSS), in MiB.
double current_rss_mib();
// Which BLAS libtorch's matrix products go through: the target of Debian's libblas.so.3
// alternative (e.g. "openblas-pthread", "blas (reference)"), or "unknown".
std::string blas_name();

// Sets the intra-op threads of libtorch (at::set_num_threads) and of the BLAS behind it: the
// pthread build of OpenBLAS keeps its own pool (sized to all cores, spinning on sched_yield)
// that at::set_num_threads does not touch, so ranks sharing a machine would oversubscribe it.
void set_threads(int threads);
// The BLAS library's own thread count where it tells (OpenBLAS), else -1.
int blas_threads();

}  // namespace dtrain::util
