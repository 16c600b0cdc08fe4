#include "dtrain/pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>

namespace dtrain::pipeline {

namespace {

void check_shape(const Shape& s) {
  if (s.ranks < 1 || s.virtual_stages < 1 || s.microbatches < 1) {
    std::ostringstream o;
    o << "pipeline schedule: ranks (" << s.ranks << "), virtual stages (" << s.virtual_stages
      << ") and micro-batches (" << s.microbatches << ") must all be at least 1";
    throw std::invalid_argument(o.str());
  }
}

void check_single_stage(const Shape& s, const std::string& name) {
  if (s.virtual_stages != 1)
    throw std::invalid_argument("pipeline schedule " + name + " runs one stage per rank; --virtual-stages " +
                                std::to_string(s.virtual_stages) + " needs --schedule interleaved");
}

Action F(int stage, int mb) { return {Kind::kForward, stage, mb}; }
Action B(int stage, int mb) { return {Kind::kBackward, stage, mb}; }

std::string label(const Action& a, const Shape& s) {
  std::string t = (a.kind == Kind::kForward ? "F" : "B") + std::to_string(a.microbatch);
  if (s.virtual_stages > 1) t += ".s" + std::to_string(a.stage);
  return t;
}

}  // namespace

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved"};
  return names;
}

Schedule gpipe(const Shape& shape) {
  check_shape(shape);
  check_single_stage(shape, "gpipe");
  Schedule s{"gpipe", shape, std::vector<std::vector<Action>>(shape.ranks)};
  for (int r = 0; r < shape.ranks; ++r) {
    for (int mb = 0; mb < shape.microbatches; ++mb) s.per_rank[r].push_back(F(r, mb));
    for (int mb = 0; mb < shape.microbatches; ++mb) s.per_rank[r].push_back(B(r, mb));
  }
  return s;
}

Schedule one_f_one_b(const Shape& shape) {
  check_shape(shape);
  check_single_stage(shape, "1f1b");
  const int p = shape.ranks, m = shape.microbatches;
  Schedule s{"1f1b", shape, std::vector<std::vector<Action>>(p)};
  for (int r = 0; r < p; ++r) {
    auto& a = s.per_rank[r];
    const int warmup = std::min(p - 1 - r, m);
    for (int mb = 0; mb < warmup; ++mb) a.push_back(F(r, mb));
    for (int i = 0; i < m - warmup; ++i) {  // steady state: one forward, one backward
      a.push_back(F(r, warmup + i));
      a.push_back(B(r, i));
    }
    for (int i = m - warmup; i < m; ++i) a.push_back(B(r, i));  // cool-down
  }
  return s;
}

Schedule interleaved_1f1b(const Shape& shape) {
  check_shape(shape);
  const int p = shape.ranks, v = shape.virtual_stages, m = shape.microbatches;
  if (v < 2)
    throw std::invalid_argument("pipeline schedule interleaved needs --virtual-stages of at least 2 (got " +
                                std::to_string(v) + "); with one stage per rank use 1f1b");
  if (m % p != 0)
    throw std::invalid_argument("pipeline schedule interleaved needs the micro-batches (" + std::to_string(m) +
                                ") to be a multiple of the pipeline ranks (" + std::to_string(p) + ")");
  // Megatron-LM's order: the k-th forward of a rank runs chunk (k / p) % v on micro-batch
  // (k / (p v)) p + k % p; backwards walk the chunks the other way.
  Schedule s{"interleaved", shape, std::vector<std::vector<Action>>(p)};
  const int total = m * v;
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  for (int r = 0; r < p; ++r) {
    auto& a = s.per_rank[r];
    const int warmup = m == p ? total : std::min(total, (p - r - 1) * 2 + (v - 1) * p);
    auto fwd = [&](int k) { a.push_back(F(chunk_of(k, true) * p + r, mb_of(k))); };
    auto bwd = [&](int k) { a.push_back(B(chunk_of(k, false) * p + r, mb_of(k))); };
    for (int k = 0; k < warmup; ++k) fwd(k);
    for (int k = 0; k < total - warmup; ++k) {
      fwd(warmup + k);
      bwd(k);
    }
    for (int k = total - warmup; k < total; ++k) bwd(k);
  }
  return s;
}

Schedule make_schedule(const std::string& name, const Shape& shape) {
  if (name == "gpipe") return gpipe(shape);
  if (name == "1f1b") return one_f_one_b(shape);
  if (name == "interleaved") return interleaved_1f1b(shape);
  throw std::invalid_argument("unknown pipeline schedule '" + name + "' (gpipe, 1f1b or interleaved)");
}

Simulation simulate(const Schedule& schedule) {
  const Shape& sh = schedule.shape;
  check_shape(sh);
  const int p = sh.ranks, S = sh.stages(), m = sh.microbatches;
  if (static_cast<int>(schedule.per_rank.size()) != p)
    throw std::invalid_argument("pipeline schedule " + schedule.name + ": " + std::to_string(schedule.per_rank.size()) +
                                " rank lists for " + std::to_string(p) + " ranks");
  // Each action once, on its stage's rank.
  std::map<std::tuple<int, int, int>, int> seen;
  for (int r = 0; r < p; ++r) {
    for (const Action& a : schedule.per_rank[r]) {
      if (a.stage < 0 || a.stage >= S || a.microbatch < 0 || a.microbatch >= m)
        throw std::invalid_argument("pipeline schedule " + schedule.name + ": rank " + std::to_string(r) + " has " +
                                    label(a, sh) + " outside " + std::to_string(S) + " stages x " +
                                    std::to_string(m) + " micro-batches");
      if (sh.rank_of(a.stage) != r)
        throw std::invalid_argument("pipeline schedule " + schedule.name + ": rank " + std::to_string(r) + " has " +
                                    label(a, sh) + " of stage " + std::to_string(a.stage) + ", which lives on rank " +
                                    std::to_string(sh.rank_of(a.stage)));
      if (++seen[{static_cast<int>(a.kind), a.stage, a.microbatch}] > 1)
        throw std::invalid_argument("pipeline schedule " + schedule.name + ": rank " + std::to_string(r) + " has " +
                                    label(a, sh) + " twice");
    }
  }
  if (static_cast<int>(seen.size()) != 2 * S * m)
    throw std::invalid_argument("pipeline schedule " + schedule.name + ": " + std::to_string(seen.size()) +
                                " actions for " + std::to_string(2 * S * m) + " (a forward and a backward per stage " +
                                "and micro-batch)");
  // Execute: an action starts when its rank is free and its inputs are there.
  std::map<std::tuple<int, int, int>, int> done;  // -> finish time
  auto finished = [&](Kind k, int stage, int mb) -> int {
    auto it = done.find({static_cast<int>(k), stage, mb});
    return it == done.end() ? -1 : it->second;
  };
  Simulation sim;
  sim.timeline.resize(p);
  sim.peak_alive.assign(p, 0);
  std::vector<size_t> next(p, 0);
  std::vector<int> free_at(p, 0), alive(p, 0);
  int busy = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (next[r] < schedule.per_rank[r].size()) {
        const Action& a = schedule.per_rank[r][next[r]];
        int ready = 0;
        if (a.kind == Kind::kForward) {
          if (a.stage > 0) ready = finished(Kind::kForward, a.stage - 1, a.microbatch);
        } else {
          const int own = finished(Kind::kForward, a.stage, a.microbatch);
          const int later = a.stage < S - 1 ? finished(Kind::kBackward, a.stage + 1, a.microbatch) : 0;
          ready = own < 0 || later < 0 ? -1 : std::max(own, later);
        }
        if (ready < 0) break;
        const int cost = a.kind == Kind::kForward ? 1 : 2;
        const int start = std::max(free_at[r], ready);
        free_at[r] = start + cost;
        busy += cost;
        done[{static_cast<int>(a.kind), a.stage, a.microbatch}] = start + cost;
        sim.timeline[r].emplace_back(start, a);
        alive[r] += a.kind == Kind::kForward ? 1 : -1;
        sim.peak_alive[r] = std::max(sim.peak_alive[r], alive[r]);
        ++next[r];
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int r = 0; r < p; ++r) {
    if (next[r] < schedule.per_rank[r].size())
      stuck << (stuck.tellp() > 0 ? ", " : "") << "rank " << r << " at " << label(schedule.per_rank[r][next[r]], sh);
  }
  if (stuck.tellp() > 0)
    throw std::invalid_argument("pipeline schedule " + schedule.name + " cannot finish (a deadlock): " + stuck.str());
  sim.makespan = *std::max_element(free_at.begin(), free_at.end());
  sim.idle_fraction = 1.0 - static_cast<double>(busy) / (static_cast<double>(p) * sim.makespan);
  sim.ideal_idle_fraction = static_cast<double>(p - 1) / (sh.virtual_stages * m + p - 1);
  return sim;
}

std::string describe(const Schedule& schedule) {
  const Simulation sim = simulate(schedule);
  const Shape& sh = schedule.shape;
  size_t width = 3;
  for (const auto& rank : sim.timeline)
    for (const auto& [t, a] : rank) width = std::max(width, label(a, sh).size() + 1);
  std::ostringstream o;
  o << "schedule " << schedule.name << ": " << sh.ranks << " rank(s) x " << sh.virtual_stages << " stage(s) each, "
    << sh.microbatches << " micro-batch(es); one column per time unit (forward 1, backward 2)\n";
  for (int r = 0; r < sh.ranks; ++r) {
    std::vector<std::string> cells(sim.makespan, ".");
    for (const auto& [t, a] : sim.timeline[r]) {
      cells[t] = label(a, sh);
      if (a.kind == Kind::kBackward) cells[t + 1] = "-";
    }
    o << "rank " << r << " |";
    for (const auto& c : cells) o << " " << c << std::string(width - c.size(), ' ');
    o << "\n";
  }
  o << "time units " << sim.makespan << ", idle " << static_cast<int>(sim.idle_fraction * 1000 + 0.5) / 10.0
    << "% (ideal bubble " << static_cast<int>(sim.ideal_idle_fraction * 1000 + 0.5) / 10.0
    << "%), most micro-batches alive per rank:";
  for (int a : sim.peak_alive) o << " " << a;
  o << "\n";
  return o.str();
}

}  // namespace dtrain::pipeline
