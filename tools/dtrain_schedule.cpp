// dtrain-schedule: prints a pipeline schedule (dtrain/pipeline/schedule.h) as a table with its
// simulated bubble and the micro-batches each rank holds at once.
//
//   build/bin/dtrain-schedule --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "dtrain/pipeline/schedule.h"

namespace {
const char* kUsage =
    "usage: dtrain-schedule --pp N [--microbatches M] [--schedule gpipe|1f1b|interleaved] [--virtual-stages V]\n"
    "Prints each rank's forwards (F<micro-batch>) and backwards (B, two time units) of one training step,\n"
    "the idle fraction against the ideal bubble (p-1)/(v m + p-1), and the micro-batches alive per rank.\n";

int positive(const std::string& flag, const std::string& v) {
  size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || n < 1) throw std::invalid_argument(flag + " needs a positive integer, got '" + v + "'");
  return n;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    int pp = 0, m = 0, v = 1;
    std::string schedule;
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      const std::string value = argv[++i];
      if (flag == "--pp") pp = positive(flag, value);
      else if (flag == "--microbatches") m = positive(flag, value);
      else if (flag == "--virtual-stages") v = positive(flag, value);
      else if (flag == "--schedule") schedule = value;
      else throw std::invalid_argument("unknown flag " + flag);
    }
    if (pp == 0) throw std::invalid_argument("--pp is required");
    if (m == 0) m = pp;
    if (schedule.empty()) schedule = v > 1 ? "interleaved" : "1f1b";
    std::fputs(dtrain::pipeline::describe(dtrain::pipeline::make_schedule(schedule, {pp, v, m})).c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-schedule: error: %s\n%s", e.what(), kUsage);
    return 2;
  }
}
