// dtrun --bind-cores (launch/cores.h, Design note [ranks bound to cores]).
#include "dtrain/launch/cores.h"

#include <sched.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

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
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

std::vector<std::vector<int>> numa_nodes() {
  std::vector<std::vector<int>> nodes;
  for (int n = 0; n < 1024; ++n) {
    std::ifstream in("/sys/devices/system/node/node" + std::to_string(n) + "/cpulist");
    if (!in) break;
    std::string list;
    std::getline(in, list);
    try {
      nodes.push_back(parse_cpu_list(list));
    } catch (const std::exception&) {
      break;
    }
  }
  return nodes;
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
  // The allowed cores of each NUMA node that has some.
  std::vector<std::vector<int>> mine;
  for (const auto& node : nodes) {
    std::vector<int> here;
    for (int c : node) {
      if (std::binary_search(cores.begin(), cores.end(), c)) here.push_back(c);
    }
    if (!here.empty()) mine.push_back(here);
  }
  const int n = static_cast<int>(mine.size());
  if (n > 1 && ranks % n == 0) {  // (each node's ranks on its own cores, as many ranks per node)
    std::vector<std::vector<int>> out;
    for (const auto& here : mine) {
      auto runs = equal_runs(here, ranks / n);
      if (runs.empty()) return equal_runs(cores, ranks);
      out.insert(out.end(), runs.begin(), runs.end());
    }
    return out;
  }
  return equal_runs(cores, ranks);
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
