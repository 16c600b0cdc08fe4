#include "testing/testing.h"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "dtrain/util/fs.h"

namespace dtrain::testing {

void run_ranks(int world, const std::function<void(comm::ProcessGroup&)>& fn, int timeout_ms) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::string first_error;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto pg = comm::ProcessGroup::create(comm::BackendKind::Gloo, store, r, world,
                                             std::chrono::milliseconds(timeout_ms));
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
