#include "dtrain/util/step_profile.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "dtrain/compat.h"
#include "dtrain/util/parse.h"

namespace dtrain::util {
namespace {
namespace prof = torch::profiler::impl;
namespace ap = torch::autograd::profiler;

std::set<prof::ActivityType> activities() {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (at::hasCUDA()) a.insert(prof::ActivityType::CUDA);
  return a;
}

void write_summary(const std::string& path, const ap::ProfilerResult& result, int64_t steps) {
  std::map<std::pair<std::string, std::string>, std::pair<int64_t, double>> sums;  // (name, device) -> (count, us)
  for (const auto& e : result.events()) {
    const std::string device = e.deviceType() == c10::DeviceType::CUDA ? "cuda" : "cpu";
    auto& s = sums[{e.name(), device}];
    s.first += 1;
    s.second += compat::profiler_event_us(e, 0);
  }
  std::vector<nlohmann::json> rows;
  for (const auto& [key, s] : sums)
    rows.push_back({{"name", key.first}, {"device", key.second}, {"count", s.first}, {"total_us", s.second}});
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a["total_us"].template get<double>() > b["total_us"].template get<double>();
  });
  std::ofstream out(path);
  out << nlohmann::json{{"steps", steps}, {"events", rows}}.dump() << "\n";
  if (!out.good()) std::fprintf(stderr, "dtrain: DTRAIN_PROFILE: cannot write %s\n", path.c_str());
}
}  // namespace

StepProfile StepProfile::from_environment(int rank) {
  StepProfile p;
  const char* env = std::getenv("DTRAIN_PROFILE");
  if (env == nullptr || *env == 0) return p;
  std::string spec = env;
  const auto at = spec.rfind('@');
  if (at != std::string::npos) {
    const std::string steps = spec.substr(at + 1);
    const auto colon = steps.find(':');
    TORCH_CHECK(colon != std::string::npos, "DTRAIN_PROFILE=", spec, ": the steps go as PATH@FIRST:LAST (1-based)");
    const auto first = parse_int(steps.substr(0, colon)), last = parse_int(steps.substr(colon + 1));
    TORCH_CHECK(first && last && *first >= 1 && *last >= *first, "DTRAIN_PROFILE=", spec,
                ": the steps go as PATH@FIRST:LAST with 1 <= FIRST <= LAST");
    p.first_ = *first;
    p.last_ = *last;
    spec.resize(at);
  }
  p.path_ = spec;
  p.write_ = rank == 0;
  return p;
}

void StepProfile::begin_step(int64_t step) {
  if (!enabled() || step != first_) return;
  try {
    const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
    ap::prepareProfiler(config, activities());
    ap::enableProfiler(config, activities());
    active_ = true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: DTRAIN_PROFILE: the profiler did not start (%s); training goes on\n", e.what());
  }
}

void StepProfile::end_step(int64_t step) {
  if (!active_ || step != last_) return;
  active_ = false;
  try {
    const auto result = ap::disableProfiler();
    if (write_ && result) write_summary(path_, *result, last_ - first_ + 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain: DTRAIN_PROFILE: the profiler did not stop cleanly (%s)\n", e.what());
  }
}

}  // namespace dtrain::util
