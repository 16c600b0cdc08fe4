// dtrun --allocator (launch/allocator.h, Design note [the workers' allocator]).
#include "dtrain/launch/allocator.h"

#include <cstdlib>
#include <vector>

#include "dtrain/launch/options.h"

namespace dtrain::launch {

namespace {

struct Known {
  Allocator kind;
  const char* name;
  std::vector<const char*> files;  // in order of preference
  const char* package;             // what to install, for the error
};

const std::vector<Known>& known() {
  static const std::vector<Known> k{
      {Allocator::Tcmalloc, "tcmalloc", {"libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"},
       "Debian/Ubuntu: apt-get install libtcmalloc-minimal4; Fedora: dnf install gperftools-libs; conda: gperftools"},
      {Allocator::Jemalloc, "jemalloc", {"libjemalloc.so.2", "libjemalloc.so"},
       "Debian/Ubuntu: apt-get install libjemalloc2; Fedora: dnf install jemalloc; conda: jemalloc"},
  };
  return k;
}

const Known& known_of(Allocator a) {
  for (const Known& k : known()) {
    if (k.kind == a) return k;
  }
  throw std::logic_error("no library for the system's allocator");
}

std::vector<std::string> library_dirs() {
  std::vector<std::string> dirs;
  if (const char* conda = std::getenv("CONDA_PREFIX"); conda && *conda) dirs.push_back(std::string(conda) + "/lib");
#if defined(__aarch64__)
  for (const char* d : {"/usr/lib/aarch64-linux-gnu", "/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib64",
                        "/usr/local/lib"}) {
#else
  for (const char* d : {"/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib64",
                        "/usr/local/lib"}) {
#endif
    dirs.emplace_back(d);
  }
  return dirs;
}

}  // namespace

const char* to_string(Allocator a) {
  switch (a) {
    case Allocator::System: return "system";
    case Allocator::Tcmalloc: return "tcmalloc";
    case Allocator::Jemalloc: return "jemalloc";
  }
  return "?";
}

std::optional<std::string> find_allocator(Allocator kind, const std::function<bool(const std::string&)>& exists) {
  if (kind == Allocator::System) return std::string();
  for (const char* file : known_of(kind).files) {
    for (const std::string& dir : library_dirs()) {
      const std::string path = dir + "/" + file;
      if (exists(path)) return path;
    }
  }
  return std::nullopt;
}

AllocatorChoice choose_allocator(const std::string& request, const std::function<bool(const std::string&)>& exists) {
  if (request == "system") return {};
  if (request == "auto") {
    for (const Known& k : known()) {  // (tcmalloc first: docs/launch.md has the measurements)
      if (auto path = find_allocator(k.kind, exists)) return {k.kind, *path, true};
    }
    return {Allocator::System, "", true};
  }
  for (const Known& k : known()) {
    if (request != k.name) continue;
    if (auto path = find_allocator(k.kind, exists)) return {k.kind, *path, false};
    throw UsageError("--allocator " + request + ": " + k.files.front() + " is not installed (" + k.package +
                     "), or use --allocator auto or system");
  }
  throw UsageError("--allocator must be auto, system, tcmalloc or jemalloc, not '" + request + "'");
}

EnvMap allocator_env(const AllocatorChoice& choice, const std::string& user_preload) {
  if (choice.kind == Allocator::System) return {};
  EnvMap env{{"LD_PRELOAD", user_preload.empty() ? choice.library : choice.library + ":" + user_preload}};
  // (gperftools prints a line for every allocation of 1 GiB or more: a model's state on the CPU)
  if (choice.kind == Allocator::Tcmalloc && !std::getenv("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD")) {
    env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = "1099511627776";
  }
  return env;
}

std::string describe(const AllocatorChoice& choice) {
  if (choice.kind == Allocator::System) return "the system's (glibc malloc)";
  return std::string(to_string(choice.kind)) + " (" + choice.library + ")";
}

}  // namespace dtrain::launch
