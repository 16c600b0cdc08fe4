// dtrun --bind-cores (launch/cores.h, Design note [ranks bound to cores]).
#include "dtrain/launch/cores.h"

#include <sched.h>

#include <algorithm>
#include <functional>
#include <map>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "dtrain/util/fs.h"

namespace dtrain::launch {

std::vector<int> parse_cpu_list(const std::string& list) {
  std::vector<int> out;
  std::istringstream in(list);
  for (std::string part; std::getline(in, part, ',');) {
    part.erase(std::remove_if(part.begin(), part.end(), [](char c) { return c == ' ' || c == '\n'; }), part.end());
    if (part.empty()) continue;
    const auto dash = part.find('-');
    try {
      const int first = std::stoi(part.substr(0, dash));
      const int last = dash == std::string::npos ? first : std::stoi(part.substr(dash + 1));
      if (first < 0 || last < first) throw std::invalid_argument("range");
      for (int c = first; c <= last; ++c) out.push_back(c);
    } catch (const std::exception&) {
      throw std::invalid_argument("not a CPU list: '" + list + "'");
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<int> allowed_cores() {
  for (int n = CPU_SETSIZE; n <= (1 << 16); n *= 4) {  // (a kernel with more CPU ids than a cpu_set_t holds: EINVAL)
    cpu_set_t* set = CPU_ALLOC(n);
    const size_t size = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(size, set);
    std::vector<int> out;
    const bool ok = sched_getaffinity(0, size, set) == 0;
    for (int c = 0; ok && c < n; ++c) {
      if (CPU_ISSET_S(c, size, set)) out.push_back(c);
    }
    CPU_FREE(set);
    if (ok) return out;
  }
  return {};
}

std::vector<std::vector<int>> numa_nodes() {
  std::vector<std::pair<int, std::vector<int>>> found;
  const std::string root = "/sys/devices/system/node";
  if (!util::fs::is_directory(root)) return {};
  for (const std::string& name : util::fs::list_directory(root)) {
    if (name.rfind("node", 0) != 0 || name.size() == 4 || name.find_first_not_of("0123456789", 4) != std::string::npos) continue;
    std::ifstream in(root + "/" + name + "/cpulist");
    std::string list;
    if (!in || !std::getline(in, list)) continue;
    try {
      found.emplace_back(std::stoi(name.substr(4)), parse_cpu_list(list));
    } catch (const std::exception&) {
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::vector<int>> nodes;
  for (auto& [n, cpus] : found) nodes.push_back(std::move(cpus));
  return nodes;
}

std::pair<int, int> physical_core_of(int cpu) {
  auto read = [cpu](const char* what) {
    std::ifstream in("/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/" + what);
    int v = -1;
    return (in >> v) ? v : -1;
  };
  const int package = read("physical_package_id"), core = read("core_id");
  return core < 0 ? std::make_pair(0, cpu) : std::make_pair(std::max(package, 0), core);
}

std::vector<int> by_physical_core(const std::vector<int>& cpus, const std::function<std::pair<int, int>(int)>& core_of) {
  std::vector<std::pair<std::pair<int, int>, int>> keyed;
  for (int c : cpus) keyed.emplace_back(core_of(c), c);
  std::stable_sort(keyed.begin(), keyed.end());
  std::vector<int> out;
  for (const auto& [key, c] : keyed) out.push_back(c);
  return out;
}

namespace {
// `cores` in `ranks` equal contiguous runs (the remainder to none); empty when a rank gets none.
std::vector<std::vector<int>> equal_runs(const std::vector<int>& cores, int ranks) {
  const int per = ranks > 0 ? static_cast<int>(cores.size()) / ranks : 0;
  if (per == 0) return {};
  std::vector<std::vector<int>> out;
  for (int r = 0; r < ranks; ++r) out.emplace_back(cores.begin() + r * per, cores.begin() + (r + 1) * per);
  return out;
}
}  // namespace

std::vector<std::vector<int>> split_cores(const std::vector<int>& cores, int ranks, const std::vector<std::vector<int>>& nodes) {
  // The cores of each NUMA node that has some, in the order given.
  std::map<int, size_t> node_of;
  for (size_t n = 0; n < nodes.size(); ++n) {
    for (int c : nodes[n]) node_of[c] = n;
  }
  std::map<size_t, std::vector<int>> mine;
  for (int c : cores) mine[node_of.count(c) ? node_of[c] : nodes.size()].push_back(c);
  const int n = static_cast<int>(mine.size());
  const bool even = std::all_of(mine.begin(), mine.end(), [&](const auto& m) { return m.second.size() == mine.begin()->second.size(); });
  std::vector<std::vector<int>> out;
  if (n > 1 && ranks % n == 0 && even) {  // (each node's ranks on its own cores, as many ranks per node, equal runs)
    for (const auto& [node, here] : mine) {
      auto runs = equal_runs(here, ranks / n);
      out.insert(out.end(), runs.begin(), runs.end());
    }
  }
  if (out.size() != static_cast<size_t>(ranks)) out = equal_runs(cores, ranks);
  for (auto& run : out) std::sort(run.begin(), run.end());
  return out;
}

std::string cpu_list(const std::vector<int>& cores) {
  std::string out;
  for (size_t i = 0; i < cores.size();) {
    size_t j = i;
    while (j + 1 < cores.size() && cores[j + 1] == cores[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(cores[i]) + (j > i ? "-" + std::to_string(cores[j]) : "");
    i = j + 1;
  }
  return out;
}

}  // namespace dtrain::launch
