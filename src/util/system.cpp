#include "dtrain/util/system.h"

#include <dlfcn.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/Parallel.h>

namespace dtrain::util {

namespace {
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
double current_rss_mib() { return status_field_mib("VmRSS"); }

std::string blas_name() {
  namespace fs = std::filesystem;
  for (const char* link : {"/etc/alternatives/libblas.so.3-x86_64-linux-gnu", "/etc/alternatives/libblas.so.3"}) {
    std::error_code ec;
    auto target = fs::read_symlink(link, ec);
    if (ec) continue;
    const std::string dir = target.parent_path().filename().string();  // openblas-pthread, blas, ...
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

}  // namespace dtrain::util
