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

}  // namespace dtrain::util
