// In-process recovery's membership and vote (train/elastic.h, Design note [in-process recovery]).
#include "dtrain/train/elastic.h"

#include <algorithm>
#include <array>
#include <map>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dtrain/comm/types.h"

namespace dtrain::train {

namespace {
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::vector<int> parse_ids(const std::string& s) {
  std::vector<int> ids;
  std::istringstream is(s);
  for (std::string id; std::getline(is, id, ',');) ids.push_back(std::stoi(id));
  return ids;
}

// "baseline;joiners;id,id,...;newcomer,..." and back.
std::string encode(const Membership& m) {
  return std::to_string(m.baseline) + ";" + std::to_string(m.joiners) + ";" + join_ids(m.ids) + ";" + join_ids(m.newcomers);
}
Membership decode(int generation, const std::string& s) {
  Membership m;
  m.generation = generation;
  std::vector<std::string> parts;
  std::istringstream is(s);
  for (std::string part; std::getline(is, part, ';');) parts.push_back(part);
  parts.resize(4);
  m.baseline = std::stoll(parts[0]);
  m.joiners = std::stoll(parts[1]);
  m.ids = parse_ids(parts[2]);
  m.newcomers = parse_ids(parts[3]);
  return m;
}

// Polls `done` with a pause growing from 50 us to 2 ms (a step's vote normally ends in the first ms).
template <class F>
void poll(F&& done) {
  auto pause = std::chrono::microseconds(50);
  while (!done()) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
}
}  // namespace

std::string join_ids(const std::vector<int>& ids, const char* sep) {
  std::string out;
  for (int id : ids) out += (out.empty() ? "" : sep) + std::to_string(id);
  return out;
}

Elastic::Elastic(comm::ProcessGroup world, ElasticOptions options)
    : store_(world.store()), kind_(world.backend_kind()), timeout_(world.timeout()), device_(world.device()),
      options_(options), id_(world.rank()), group_(std::move(world)) {
  members_.generation = 0;
  for (int r = 0; r < group_.size(); ++r) members_.ids.push_back(r);
  group_.abort_signal()->arm();
  watcher_ = std::thread([this] { watch(); });
}

Elastic::Elastic(c10::intrusive_ptr<c10d::Store> store, int id, comm::BackendKind kind, std::chrono::milliseconds timeout,
                 c10::Device device, ElasticOptions options)
    : store_(std::move(store)), kind_(kind), timeout_(timeout), device_(device), options_(options), id_(id) {}

std::unique_ptr<Elastic> Elastic::join(c10::intrusive_ptr<c10d::Store> store, int id, comm::BackendKind kind,
                                       std::chrono::milliseconds timeout, c10::Device device, ElasticOptions options) {
  std::unique_ptr<Elastic> e(new Elastic(std::move(store), id, kind, timeout, device, options));
  const int64_t n = e->store_->add("elastic/joiners", 1);  // (its slot: written next; deciders wait for it)
  e->store_->set("elastic/joiner/" + std::to_string(n), bytes(std::to_string(id)));
  const auto deadline = Clock::now() + timeout;
  Membership m;
  poll([&] {
    if (Clock::now() >= deadline) {  // (dead to the job first: its exit is no failure of the members' step)
      e->store_->set("elastic/dead/" + std::to_string(id), bytes("1"));
      TORCH_CHECK(false, "rank ", id, ": no generation of the job took this joining process in within ",
                  timeout.count() / 1000, " s (--collective-timeout): is the job still training with --elastic? (in whole "
                  "units, a joiner waits for the others of its unit: Design note [whole units])");
    }
    if (e->store_->check({"elastic/finished"})) {
      throw RunEnded("rank " + std::to_string(id) + ": the run ended before this process could join it; nothing to do");
    }
    if (!e->store_->check({"elastic/latest"})) return false;
    const int g = std::stoi(text(e->store_->get("elastic/latest")));
    m = decode(g, text(e->store_->get(e->key(g, "members"))));
    return std::find(m.ids.begin(), m.ids.end(), id) != m.ids.end();
  });
  e->last_generation_ = m.generation;
  e->make_group(m);
  e->watcher_ = std::thread([raw = e.get()] { raw->watch(); });
  return e;
}

void Elastic::finish() { store_->set("elastic/finished", bytes("1")); }

bool Elastic::newcomer() const {
  return std::find(members_.newcomers.begin(), members_.newcomers.end(), id_) != members_.newcomers.end();
}

Elastic::~Elastic() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  // Deliberately leaked (Design note [in-process recovery]): an aborted Gloo group's destructor
  // waits for its stuck operation's timeout; the process exits with it instead.
  if (!retired_.empty()) new std::vector<comm::ProcessGroup>(std::move(retired_));
}

std::string Elastic::key(int generation, const std::string& what) const {
  return "elastic/g" + std::to_string(generation) + "/" + what;
}

void Elastic::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, options_.watch_interval(), [this] { return stop_; })) {
    try {
      const int64_t failures = store_->add("elastic/failures", 0);
      static const bool trace = std::getenv("DTRAIN_ELASTIC_TRACE") != nullptr;  // (docs/elastic.md)
      static int64_t seen = -1;
      if (trace && failures != seen) {
        std::fprintf(stderr, "elastic trace id %d: failures %lld baseline %lld generation %d aborted %d\n", id_,
                     static_cast<long long>(failures), static_cast<long long>(members_.baseline), members_.generation,
                     static_cast<int>(group_.abort_signal()->aborted()));
        seen = failures;
      }
      if (group_.abort_signal()->aborted()) continue;
      // (a second reason, whatever the count says: another member already went on to the next generation;
      // not where this generation's last commit decided to grow: every member goes on by plan, and one
      // that went first must not cut the others' last waits of this generation, e.g. a partner
      // snapshot's exchange the first saw complete a moment before they did)
      const std::string next = key(members_.generation + 1, "started");
      if (failures <= members_.baseline && (grow_due_.load() || !store_->check({next}))) continue;
      const std::string why = "elastic/why/" + std::to_string(members_.baseline + 1);
      group_.abort_signal()->abort(store_->check({why}) ? text(store_->get(why))
                                                        : "a member went on to generation " + std::to_string(members_.generation + 1));
    } catch (const std::exception& e) {  // (the store unreachable: this generation cannot vote; later ones are watched)
      group_.abort_signal()->abort(std::string("the job's store is unreachable: ") + e.what());
    }
  }
}

void Elastic::report_failure(const std::string& why) {
  const int64_t n = store_->add("elastic/failures", 1);
  store_->set("elastic/why/" + std::to_string(n), bytes("rank " + std::to_string(id_) + ": " + why));
  std::lock_guard<std::mutex> lock(mu_);
  group_.abort_signal()->abort("rank " + std::to_string(id_) + ": " + why);
}

void Elastic::request_restart(const std::string& why) {
  store_->compareSet("elastic/restart", {}, bytes("rank " + std::to_string(id_) + ": " + why));  // (the first reason)
}

bool Elastic::commit(int64_t step) {
  const int generation = members_.generation;
  const std::string base = key(generation, "s" + std::to_string(step));
  const auto size = static_cast<int64_t>(members_.ids.size());
  store_->add(base + "/ok", 1);
  poll([&] {
    if (store_->check({base + "/decision"})) return true;
    if (store_->add(base + "/ok", 0) == size) {
      store_->compareSet(base + "/decision", {}, bytes("commit:" + std::to_string(members_.joiners + joiners_waiting())));
      return true;
    }
    // (a failure counted, or seen otherwise: this rank's group aborted, or a member already regrouping)
    if (store_->add("elastic/failures", 0) > members_.baseline || group_.abort_signal()->aborted() ||
        store_->check({key(generation + 1, "started")})) {
      store_->compareSet(base + "/decision", {}, bytes("abort"));
      return true;
    }
    return false;
  });
  const std::string decision = text(store_->get(base + "/decision"));
  const bool committed = decision.rfind("commit:", 0) == 0;
  // (the joiners alive and waiting fill a unit at least: Design note [whole units])
  grow_due_ = committed && std::stoll(decision.substr(7)) >= members_.joiners + units_.size();
  // (the keys of two steps back: every member has read that decision before voting on this one)
  if (id_ == members_.ids.front() && step > 2) {
    const std::string old = key(generation, "s" + std::to_string(step - 2));
    store_->deleteKey(old + "/ok");
    store_->deleteKey(old + "/decision");
  }
  return committed;
}

namespace {

// A rank's place in a world of `world` ranks under `u` (parallel/layout.h's rank formula, the
// data-parallel rank split into unit and shard rank): {stage, unit, shard rank, tensor rank}.
using Place = std::array<int, 4>;
Place place_of(int rank, int world, const Units& u) {
  const int d = world / (u.tensor * u.pipeline);
  const int dp = (rank / u.tensor) % d;
  return {rank / (u.tensor * d), dp / u.shard, dp % u.shard, rank % u.tensor};
}

// The place of the o-th rank of a unit that joins as unit `unit` ({stage, shard, tensor} in order).
Place joining_place(int o, int unit, const Units& u) {
  return {o / (u.shard * u.tensor), unit, (o / u.tensor) % u.shard, o % u.tensor};
}

}  // namespace

int64_t Elastic::joiners_waiting() const {
  const int64_t registered = store_->add("elastic/joiners", 0);
  int64_t alive = 0;
  for (int64_t k = members_.joiners + 1; k <= registered; ++k) {  // (rarely any: a replacement on its way)
    const std::string slot = "elastic/joiner/" + std::to_string(k);
    if (!store_->check({slot})) break;
    alive += store_->check({"elastic/dead/" + text(store_->get(slot))}) ? 0 : 1;
  }
  return alive;
}

Membership choose_members(const Membership& current, const std::vector<int>& survivors,
                          const std::vector<JoinerSlot>& slots, const Units& u) {
  const int world = static_cast<int>(current.ids.size());
  std::vector<std::pair<Place, int>> placed;  // (place, id)
  std::map<int, std::vector<int>> units;      // unit -> the ranks of it that survived
  for (int r = 0; r < world; ++r) {
    if (std::find(survivors.begin(), survivors.end(), current.ids[r]) != survivors.end()) {
      units[place_of(r, world, u)[1]].push_back(r);
    }
  }
  int kept = 0;
  for (const auto& [unit, ranks] : units) {
    if (static_cast<int>(ranks.size()) != u.size()) continue;  // (a unit that lost a member leaves whole)
    for (int r : ranks) {
      Place p = place_of(r, world, u);
      p[1] = kept;
      placed.emplace_back(p, current.ids[r]);
    }
    ++kept;
  }
  Membership m{current.generation + 1, {}, current.baseline, current.joiners, {}};
  // The joiners in their order: taken in whole units; a dead one is passed over (counted as seen)
  // unless an alive one before it waits for its unit to fill.
  const auto alive = static_cast<size_t>(std::count_if(slots.begin(), slots.end(), [](const JoinerSlot& j) { return !j.dead; }));
  // (none when no survivor's unit came whole: a generation of joiners alone would hold none of the
  // trained state; the survivors refuse instead, Elastic::regroup)
  const size_t take = kept == 0 ? 0 : alive / u.size() * u.size();
  size_t taken = 0;
  for (const JoinerSlot& j : slots) {
    if (j.dead) {
      m.joiners = j.slot;  // (every alive one before it is taken: the loop stops at the first that is not)
      continue;
    }
    if (taken == take) break;
    placed.emplace_back(joining_place(static_cast<int>(taken % u.size()), kept + static_cast<int>(taken / u.size()), u), j.id);
    m.newcomers.push_back(j.id);
    m.joiners = j.slot;
    ++taken;
  }
  std::sort(placed.begin(), placed.end());
  for (const auto& [place, id] : placed) m.ids.push_back(id);
  return m;
}

// Design note [whole units] (elastic.h): the survivors' complete units keep their places; the
// joiners registered by now come in whole units after them.
Membership Elastic::choose(int generation, const std::vector<int>& survivors) {
  std::vector<JoinerSlot> slots;
  const int64_t registered = store_->add("elastic/joiners", 0);
  for (int64_t k = members_.joiners + 1; k <= registered; ++k) {
    const std::string slot = "elastic/joiner/" + std::to_string(k);
    if (!store_->check({slot})) break;  // (its slot not written yet: taken in next time, with those after it)
    const int id = std::stoi(text(store_->get(slot)));
    slots.push_back({k, id, store_->check({"elastic/dead/" + std::to_string(id)})});
  }
  Membership current = members_;
  current.generation = generation - 1;
  current.baseline = store_->add("elastic/failures", 0);
  return choose_members(current, survivors, slots, units_);
}

Membership Elastic::decide(int generation) {
  const std::string members_key = key(generation, "members");
  const auto deadline = Clock::now() + options_.join_timeout();
  poll([&] {
    if (store_->check({members_key})) return true;
    std::vector<int> joined;
    bool all_known = true;
    for (int id : members_.ids) {
      const bool dead = store_->check({"elastic/dead/" + std::to_string(id)});
      const bool in = store_->check({key(generation, "join/" + std::to_string(id))});
      if (in && !dead) joined.push_back(id);
      all_known = all_known && (in || dead);
    }
    if (!all_known && Clock::now() < deadline) return false;
    store_->compareSet(members_key, {}, bytes(encode(choose(generation, joined))));
    return true;
  });
  Membership m = decode(generation, text(store_->get(members_key)));
  store_->set("elastic/latest", bytes(std::to_string(generation)));  // (for joiners; every member writes the same)
  return m;
}

comm::ProcessGroup Elastic::regroup(int64_t next_step) {
  // (a recovery that failed itself, e.g. a member lost while the group was made, used its number)
  const int generation = ++last_generation_;
  store_->set(key(generation, "started"), bytes("1"));  // (the others' watchers abort their waits: watch)
  store_->set(key(generation, "join/" + std::to_string(id_)), bytes(std::to_string(next_step)));
  Membership m = decide(generation);
  if (m.ids.empty()) {  // (no unit came whole: nobody can go on in process)
    const std::string why = "no whole unit of " + std::to_string(units_.size()) + " ranks (one whole replica of the model) "
                            "is left at generation " + std::to_string(generation) + ", so the recovery in process is "
                            "refused (Design note [whole units])";
    request_restart(why);
    store_->set("elastic/dead/" + std::to_string(id_), bytes("1"));
    throw LeftOut("rank " + std::to_string(id_) + ": " + why + "; dtrun restarts every worker from the newest checkpoint "
                  "(--max-restarts, --save/--resume) or ends the job");
  }
  const auto me = std::find(m.ids.begin(), m.ids.end(), id_);
  if (me == m.ids.end()) {
    // (dead to the job: dtrun counts no failure when this process ends, so the new generation's
    // watchers do not abort its first step)
    store_->set("elastic/dead/" + std::to_string(id_), bytes("1"));
    const std::string lost = lost_unit_mates();
    if (!lost.empty()) {
      throw LeftOut("rank " + std::to_string(id_) + " leaves the job at generation " + std::to_string(generation) +
                    ": its unit of " + std::to_string(units_.size()) + " ranks (one whole replica of the model) lost rank(s) " +
                    lost + ", and the members go on in whole units (Design note [whole units]); members: ranks " +
                    join_ids(m.ids, ", ") + " of the first generation");
    }
    throw LeftOut("rank " + std::to_string(id_) + " was left out of generation " + std::to_string(generation) +
                             " (members: ranks " + join_ids(m.ids, ", ") + " of the first generation): it joined after the "
                             "others decided (--elastic-join-timeout)");
  }
  for (int id : m.ids) {
    if (std::find(m.newcomers.begin(), m.newcomers.end(), id) != m.newcomers.end()) continue;  // (a joiner redoes nothing)
    const int64_t theirs = std::stoll(text(store_->get(key(generation, "join/" + std::to_string(id)))));
    if (theirs != next_step) {
      throw std::runtime_error("rank " + std::to_string(id_) + " would redo step " + std::to_string(next_step + 1) +
                               " but rank " + std::to_string(id) + " step " + std::to_string(theirs + 1) +
                               ": the survivors disagree on the last committed step (a bug: please report it)");
    }
  }
  grow_due_ = false;
  return make_group(m);
}

std::string Elastic::lost_unit_mates() const {
  const int world = static_cast<int>(members_.ids.size());
  const auto me = std::find(members_.ids.begin(), members_.ids.end(), id_);
  if (units_.size() == 1 || me == members_.ids.end()) return "";
  const int unit = place_of(static_cast<int>(me - members_.ids.begin()), world, units_)[1];
  std::vector<int> lost;
  for (int r = 0; r < world; ++r) {
    const int id = members_.ids[r];
    if (place_of(r, world, units_)[1] == unit && store_->check({"elastic/dead/" + std::to_string(id)}) && id != id_) {
      lost.push_back(id);
    }
  }
  return join_ids(lost, ", ");
}

comm::ProcessGroup Elastic::make_group(const Membership& m) {
  const auto me = std::find(m.ids.begin(), m.ids.end(), id_);
  const int rank = static_cast<int>(me - m.ids.begin());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(key(m.generation, "group"), store_);
  comm::ProcessGroup next =
      comm::ProcessGroup::create(kind_, prefixed, rank, static_cast<int>(m.ids.size()), timeout_, {}, device_);
  next.abort_signal()->arm();
  std::lock_guard<std::mutex> lock(mu_);
  if (group_.is_member()) retired_.push_back(group_);
  group_ = next;
  members_ = m;
  return next;
}

}  // namespace dtrain::train
