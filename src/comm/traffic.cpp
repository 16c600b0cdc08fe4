#include "dtrain/comm/traffic.h"

#include <atomic>
#include <mutex>

#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

namespace {
std::atomic<int64_t> counters[7];
std::atomic<int64_t> calls{0};
std::atomic<int64_t> ring_sent{0};
std::atomic<int64_t> across_sent{0};
std::mutex groups_mutex;
std::map<std::string, Traffic::Group>& groups() {
  static auto* g = new std::map<std::string, Traffic::Group>();  // (guarded by groups_mutex; never destroyed:
  return *g;                                                     // a left-alone group's thread may count late)
}

// The share of `sent` that goes to another node (see traffic.h).
double across_share(detail::TrafficKind kind, const ProcessGroup& pg, int peer, bool direct) {
  const std::vector<int>& nodes = pg.member_nodes();
  const int me = pg.rank(), n = pg.size();
  if (static_cast<int>(nodes.size()) != n || n == 1) return 0.0;
  if (kind == detail::TrafficKind::Send) return peer >= 0 && peer < n && nodes[peer] != nodes[me] ? 1.0 : 0.0;
  if (kind == detail::TrafficKind::AllToAll || direct) {  // (an even share to each of the n - 1 others)
    int away = 0;
    for (int r = 0; r < n; ++r) away += nodes[r] != nodes[me];
    return static_cast<double>(away) / (n - 1);
  }
  return nodes[(me + 1) % n] != nodes[me] ? 1.0 : 0.0;
}
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
  t.across_nodes_sent = across_sent.load();
  std::lock_guard<std::mutex> lock(groups_mutex);
  t.by_group = groups();
  return t;
}

namespace detail {
namespace {
void add(TrafficKind kind, int64_t payload, int64_t whole, int64_t across, const ProcessGroup& pg) {
  counters[static_cast<int>(kind)].fetch_add(payload, std::memory_order_relaxed);
  ring_sent.fetch_add(whole, std::memory_order_relaxed);
  across_sent.fetch_add(across, std::memory_order_relaxed);
  calls.fetch_add(1, std::memory_order_relaxed);
  if (whole > 0) {
    std::lock_guard<std::mutex> lock(groups_mutex);
    Traffic::Group& g = groups()[pg.label()];
    g.sent += whole;
    g.across_nodes += across;
  }
}
}  // namespace

void count_traffic(TrafficKind kind, int64_t bytes, const ProcessGroup& pg, int peer, bool direct) {
  const int group_size = pg.size();
  const double share = group_size > 1 ? static_cast<double>(group_size - 1) / group_size : 0.0;
  double sent = bytes;
  if (kind == TrafficKind::AllReduce) sent = 2 * share * bytes;
  if (kind == TrafficKind::AllGather || kind == TrafficKind::ReduceScatter || kind == TrafficKind::AllToAll ||
      kind == TrafficKind::Broadcast) {
    sent = share * bytes;
  }
  if (kind == TrafficKind::Recv) sent = 0;
  add(kind, bytes, static_cast<int64_t>(sent), static_cast<int64_t>(sent * across_share(kind, pg, peer, direct)), pg);
}

void count_all_to_all(const std::vector<int64_t>& bytes_to, const ProcessGroup& pg) {
  const std::vector<int>& nodes = pg.member_nodes();
  const int me = pg.rank();
  int64_t payload = 0, sent = 0, across = 0;
  for (int r = 0; r < static_cast<int>(bytes_to.size()); ++r) {
    payload += bytes_to[static_cast<size_t>(r)];
    if (r == me) continue;
    sent += bytes_to[static_cast<size_t>(r)];
    if (nodes.size() == bytes_to.size() && nodes[static_cast<size_t>(r)] != nodes[static_cast<size_t>(me)]) {
      across += bytes_to[static_cast<size_t>(r)];
    }
  }
  add(TrafficKind::AllToAll, payload, sent, across, pg);
}
}  // namespace detail

}  // namespace dtrain::comm
