// Collective timings over the local Gloo group (run under dtrun): all_reduce vs the flat
// reduce_scatter and all_gather that libtorch 1.13's Gloo lacks. A reduce-scatter moves half the
// bytes of an all-reduce, so it should take about half the time; if it were an all-reduce in
// disguise the two would match.
//   build/bin/dtrun --standalone --nproc-per-node 2 build/bin/dtrain-comm-bench [FLOATS]
// FLOATS: time that size only (bench/elastic_link_bench.py measures a link's bandwidth with it).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/comm.h"

using namespace dtrain::comm;

namespace {
double median_ms(const std::function<void()>& fn, int iters) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  auto pg = init_process_group();
  const int world = pg.size();
  if (pg.rank() == 0) {
    std::printf("collective timings, %d ranks, Gloo (median of 20)\n", world);
    std::printf("%12s %14s %18s %16s %10s\n", "floats", "all_reduce ms", "reduce_scatter ms", "all_gather ms", "rs / ar");
  }
  std::vector<int64_t> sizes{int64_t(1) << 18, int64_t(1) << 20, int64_t(1) << 22};
  if (argc > 1) sizes = {std::atoll(argv[1])};
  for (int64_t n : sizes) {
    auto full = at::ones({n});
    auto part = at::empty({(n + world - 1) / world});
    auto counts = even_split(n, world);
    auto mine = at::empty({counts[pg.rank()]});
    double ar = median_ms([&] { all_reduce(pg, full); }, 20);
    double rs = median_ms([&] { reduce_scatter(pg, mine, full, ReduceScatterOptions().counts(counts)); }, 20);
    double ag = median_ms([&] { all_gather(pg, full, mine, AllGatherOptions().counts(counts)); }, 20);
    if (pg.rank() == 0) std::printf("%12lld %14.2f %18.2f %16.2f %10.2f\n", static_cast<long long>(n), ar, rs, ag, rs / ar);
  }
  return 0;
}
