#include "testing/testing.h"

#include <array>
#include <fstream>
#include <sstream>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "dtrain/comm/barrier.h"
#include "dtrain/util/fs.h"

namespace dtrain::testing {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void run_ranks(int world, const std::function<void(comm::ProcessGroup&)>& fn, int timeout_ms,
               const std::vector<int>& nodes) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::string first_error;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = comm::ProcessGroup::create(comm::BackendKind::Gloo, store, r, world,
                                             std::chrono::milliseconds(timeout_ms), {}, c10::Device(c10::kCPU),
                                             nodes.empty() ? -1 : nodes.at(static_cast<size_t>(r)));
        fn(pg);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) first_error = "rank " + std::to_string(r) + ": " + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!first_error.empty()) throw std::runtime_error(first_error);
}

comm::Traffic traffic_at_rest(const comm::ProcessGroup& pg) {
  comm::barrier(pg);
  const comm::Traffic t = comm::traffic();
  comm::barrier(pg);
  return t;
}

CommandResult run_command(const std::string& command, int timeout_s) {
  std::string full = "timeout -k 5 " + std::to_string(timeout_s) + " /bin/sh -c '";
  for (char c : command) {
    if (c == '\'') full += "'\\''";
    else full += c;
  }
  full += "' 2>&1";
  CommandResult result;
  FILE* pipe = popen(full.c_str(), "r");
  if (!pipe) throw std::runtime_error("popen failed for: " + command);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) result.output.append(buf.data(), n);
  int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

std::string bin(const std::string& name) { return std::string(DTRAIN_BIN_DIR) + "/" + name; }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

namespace {
void write_all(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  { std::ofstream(tmp, std::ios::binary) << text; }
  std::rename(tmp.c_str(), path.c_str());  // (atomic: a concurrent reader sees all or nothing)
}
// Size and mtime of a file (its target when a link), or "-".
std::string stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "-";
  return std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
}
}  // namespace

SharedRun shared_run(const std::string& key, const std::vector<std::string>& programs,
                     const std::function<SharedRun()>& run) {
  const char* off = std::getenv("DTRAIN_TEST_NO_SHARED_RUNS");
  if (off && std::string(off) == "1") return run();
  std::string identity = key;
  for (const auto& p : programs) identity += "|" + p + "=" + stamp(bin(p));
  identity += "|lib=" + stamp(std::string(DTRAIN_BIN_DIR) + "/../lib/libdtrain.so");
  const std::string dir = std::string(DTRAIN_BIN_DIR) + "/../test-run-cache";
  dtrain::util::fs::create_directories(dir);
  char name[32];
  std::snprintf(name, sizeof name, "%016zx", std::hash<std::string>{}(identity));
  const std::string base = dir + "/" + name;
  if (read_file(base + ".key") == identity) {
    SharedRun r;
    r.exit_code = std::atoi(read_file(base + ".rc").c_str());
    r.output = read_file(base + ".out");
    r.metrics = read_file(base + ".jsonl");
    return r;
  }
  SharedRun r = run();
  write_all(base + ".rc", std::to_string(r.exit_code));
  write_all(base + ".out", r.output);
  write_all(base + ".jsonl", r.metrics);
  write_all(base + ".key", identity);  // (last: the entry is complete once its key is there)
  return r;
}

namespace {
struct TempDirs {
  std::vector<std::string> dirs;
  ~TempDirs() {
    for (auto& d : dirs) dtrain::util::fs::remove_all(d);
  }
};
TempDirs& temp_dirs() {
  static TempDirs t;
  return t;
}
}  // namespace

std::string temp_dir() {
  std::string tmpl = dtrain::util::fs::join(dtrain::util::fs::temp_directory(), "dtrain-test-XXXXXX");
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  temp_dirs().dirs.push_back(tmpl);
  return tmpl;
}

}  // namespace dtrain::testing
