#include "dtrain/launch/stall.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "dtrain/comm/flight_recorder.h"

namespace dtrain::launch {

namespace fl = dtrain::comm::flight;

char process_state(pid_t pid, double* cpu_s) {
  *cpu_s = -1;
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return '?';
  const auto close = text.rfind(')');  // (the command name may hold spaces and parentheses)
  if (close == std::string::npos || close + 2 >= text.size()) return '?';
  std::istringstream rest(text.substr(close + 2));
  std::string state;
  rest >> state;
  std::string skip;
  for (int field = 4; field <= 13; ++field) rest >> skip;  // ppid .. cmajflt
  unsigned long long utime = 0, stime = 0;
  rest >> utime >> stime;
  const long hz = ::sysconf(_SC_CLK_TCK);
  *cpu_s = static_cast<double>(utime + stime) / static_cast<double>(hz > 0 ? hz : 100);
  return state.empty() ? '?' : state[0];
}

StallMonitor::StallMonitor(std::string flight_dir, double timeout_s)
    : dir_(std::move(flight_dir)), timeout_s_(timeout_s) {
  reset();
}

void StallMonitor::reset() {
  seen_.clear();
  last_progress_ = last_sample_ = std::chrono::steady_clock::now();
}

double StallMonitor::seconds_without_progress() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - last_progress_).count();
}

bool StallMonitor::stalled(const std::vector<WatchedRank>& ranks) {
  const auto now = std::chrono::steady_clock::now();
  const double interval = std::chrono::duration<double>(now - last_sample_).count();
  if (interval < 0.5) return seconds_without_progress() >= timeout_s_;
  last_sample_ = now;
  bool progress = false;
  for (const auto& r : ranks) {
    Seen now_seen;
    process_state(r.pid, &now_seen.cpu_s);
    if (auto events = fl::read_events(fl::file_for(dir_, r.rank))) now_seen.events = *events;
    auto it = seen_.find(r.rank);
    if (it == seen_.end()) {
      progress = true;  // a rank seen for the first time (just started)
    } else {
      progress |= now_seen.events != it->second.events;
      progress |= now_seen.cpu_s >= 0 && it->second.cpu_s >= 0 && now_seen.cpu_s - it->second.cpu_s >= 0.05 * interval;
    }
    seen_[r.rank] = now_seen;
  }
  if (progress) last_progress_ = now;
  return seconds_without_progress() >= timeout_s_;
}

namespace {

std::string state_name(char s) {
  switch (s) {
    case 'R': return "running";
    case 'S': return "sleeping";
    case 'D': return "in uninterruptible I/O";
    case 'T': case 't': return "STOPPED";
    case 'Z': return "exited (zombie)";
    default: return "gone";
  }
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// The operation a rank is in: its latest Started entry (nullptr when none).
const fl::Entry* in_flight(const fl::Snapshot& s) {
  for (auto it = s.entries.rbegin(); it != s.entries.rend(); ++it) {
    if (it->state == static_cast<uint32_t>(fl::OpState::Started)) return &*it;
  }
  return nullptr;
}

}  // namespace

std::string StallMonitor::report(const std::vector<WatchedRank>& ranks) const {
  const double now = fl::now_seconds();
  std::ostringstream os;
  char buf[160];
  std::map<int, fl::Snapshot> snaps;
  std::map<int, char> states;
  for (const auto& r : ranks) {
    double cpu = -1;
    const char st = process_state(r.pid, &cpu);
    states[r.rank] = st;
    auto s = fl::read_file(fl::file_for(dir_, r.rank));
    std::snprintf(buf, sizeof(buf), "  rank %d (pid %d, %s, %.1f s CPU", r.rank, static_cast<int>(r.pid),
                  state_name(st).c_str(), cpu);
    os << buf;
    if (s && s->step > 0) os << ", after step " << s->step;
    os << "):";
    if (!s) {
      os << " no flight recorder (not a dtrain program, or it has not communicated yet)\n";
      continue;
    }
    if (const fl::Entry* e = in_flight(*s)) {
      std::snprintf(buf, sizeof(buf), " in %s of group %s #%llu for %.1f s\n", e->what, e->group,
                    static_cast<unsigned long long>(e->seq), now - e->start_s);
      os << buf;
    } else if (!s->entries.empty()) {
      const fl::Entry& e = s->entries.back();
      std::snprintf(buf, sizeof(buf), " in no collective; the last, %s of group %s #%llu, ended %.1f s ago\n", e.what,
                    e.group, static_cast<unsigned long long>(e.seq), now - e.end_s);
      os << buf;
    } else {
      os << " no operation recorded yet\n";
    }
    snaps.emplace(r.rank, std::move(*s));
  }
  // The diagnosis.
  std::vector<int> stopped;
  for (const auto& [rank, st] : states) {
    if (st == 'T' || st == 't') stopped.push_back(rank);
  }
  if (!stopped.empty()) os << "  => rank(s) " << rank_list(stopped) << " stopped (SIGSTOP or a debugger)\n";
  // Per group: where the ranks in flight are, and who never reached the operation they wait in.
  std::map<std::string, std::map<std::pair<uint64_t, std::string>, std::vector<int>>> waiting;
  for (const auto& [rank, s] : snaps) {
    if (const fl::Entry* e = in_flight(s)) waiting[e->group][{e->seq, e->what}].push_back(rank);
  }
  for (const auto& [group, at] : waiting) {
    if (at.size() > 1) {
      os << "  => ranks disagree in group " << group << ":";
      bool first = true;
      for (const auto& [op, who] : at) {
        os << (first ? " " : "; ") << "rank(s) " << rank_list(who) << " in " << op.second << " #" << op.first;
        first = false;
      }
      os << "\n";
    }
    const auto& [op, who] = *at.rbegin();  // the furthest operation ranks wait in
    std::vector<int> behind;
    for (const auto& [rank, s] : snaps) {
      if (std::find(who.begin(), who.end(), rank) != who.end()) continue;
      uint64_t last = 0;
      bool member = false;
      for (const auto& e : s.entries) {
        if (group == e.group) {
          member = true;
          last = std::max<uint64_t>(last, e.seq);
        }
      }
      if ((member || group == "world") && last < op.first && !in_flight(s)) behind.push_back(rank);
    }
    if (!behind.empty()) {
      os << "  => rank(s) " << rank_list(behind) << " never reached " << op.second << " #" << op.first << " of group "
         << group << " that rank(s) " << rank_list(who) << " wait in: "
         << (std::all_of(behind.begin(), behind.end(),
                         [&](int r) { return states[r] == 'T' || states[r] == 't'; })
                 ? "stopped"
                 : "stuck outside communication (computing, in I/O, or deadlocked)")
         << "\n";
    }
  }
  return os.str();
}

}  // namespace dtrain::launch
