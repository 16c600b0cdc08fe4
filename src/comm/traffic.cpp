#include "dtrain/comm/traffic.h"

#include <atomic>

namespace dtrain::comm {

namespace {
std::atomic<int64_t> counters[7];
std::atomic<int64_t> calls{0};
std::atomic<int64_t> ring_sent{0};
}  // namespace

Traffic traffic() {
  Traffic t;
  t.all_reduce = counters[0].load();
  t.all_gather = counters[1].load();
  t.reduce_scatter = counters[2].load();
  t.broadcast = counters[3].load();
  t.send = counters[4].load();
  t.recv = counters[5].load();
  t.all_to_all = counters[6].load();
  t.calls = calls.load();
  t.ring_bytes_sent = ring_sent.load();
  return t;
}

namespace detail {
void count_traffic(TrafficKind kind, int64_t bytes, int group_size) {
  counters[static_cast<int>(kind)].fetch_add(bytes, std::memory_order_relaxed);
  const double share = group_size > 1 ? static_cast<double>(group_size - 1) / group_size : 0.0;
  double sent = bytes;
  if (kind == TrafficKind::AllReduce) sent = 2 * share * bytes;
  if (kind == TrafficKind::AllGather || kind == TrafficKind::ReduceScatter || kind == TrafficKind::AllToAll ||
      kind == TrafficKind::Broadcast) {
    sent = share * bytes;
  }
  if (kind == TrafficKind::Recv) sent = 0;
  ring_sent.fetch_add(static_cast<int64_t>(sent), std::memory_order_relaxed);
  calls.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace detail

}  // namespace dtrain::comm
