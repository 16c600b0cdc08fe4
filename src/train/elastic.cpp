// In-process recovery's membership and vote (train/elastic.h, Design note [in-process recovery]).
#include "dtrain/train/elastic.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dtrain/comm/types.h"

namespace dtrain::train {

namespace {
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// "baseline;id,id,..." and back.
std::string encode(const Membership& m) {
  std::ostringstream os;
  os << m.baseline << ";";
  for (size_t i = 0; i < m.ids.size(); ++i) os << (i ? "," : "") << m.ids[i];
  return os.str();
}
Membership decode(int generation, const std::string& s) {
  Membership m;
  m.generation = generation;
  const auto semi = s.find(';');
  m.baseline = std::stoll(s.substr(0, semi));
  std::istringstream is(s.substr(semi + 1));
  for (std::string id; std::getline(is, id, ',');) m.ids.push_back(std::stoi(id));
  return m;
}

std::string join_ids(const std::vector<int>& ids) {
  std::string out;
  for (int id : ids) out += (out.empty() ? "" : ", ") + std::to_string(id);
  return out;
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

Elastic::Elastic(comm::ProcessGroup world, ElasticOptions options)
    : store_(world.store()), kind_(world.backend_kind()), timeout_(world.timeout()), device_(world.device()),
      options_(options), id_(world.rank()), group_(std::move(world)) {
  members_.generation = 0;
  for (int r = 0; r < group_.size(); ++r) members_.ids.push_back(r);
  group_.abort_signal()->arm();
  watcher_ = std::thread([this] { watch(); });
}

Elastic::~Elastic() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watcher_.join();
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
      if (failures <= members_.baseline || group_.abort_signal()->aborted()) continue;
      const std::string why = "elastic/why/" + std::to_string(members_.baseline + 1);
      group_.abort_signal()->abort(store_->check({why}) ? text(store_->get(why)) : std::string("a rank failed"));
    } catch (const std::exception& e) {  // (the store gone: the job is ending; the waits time out)
      group_.abort_signal()->abort(std::string("the job's store is unreachable: ") + e.what());
      return;
    }
  }
}

void Elastic::report_failure(const std::string& why) {
  const int64_t n = store_->add("elastic/failures", 1);
  store_->set("elastic/why/" + std::to_string(n), bytes("rank " + std::to_string(id_) + ": " + why));
  std::lock_guard<std::mutex> lock(mu_);
  group_.abort_signal()->abort("rank " + std::to_string(id_) + ": " + why);
}

bool Elastic::commit(int64_t step) {
  const int generation = members_.generation;
  const std::string base = key(generation, "s" + std::to_string(step));
  const auto size = static_cast<int64_t>(members_.ids.size());
  store_->add(base + "/ok", 1);
  poll([&] {
    if (store_->check({base + "/decision"})) return true;
    if (store_->add(base + "/ok", 0) == size) {
      store_->compareSet(base + "/decision", {}, bytes("commit"));
      return true;
    }
    if (store_->add("elastic/failures", 0) > members_.baseline) {
      store_->compareSet(base + "/decision", {}, bytes("abort"));
      return true;
    }
    return false;
  });
  const bool committed = text(store_->get(base + "/decision")) == "commit";
  // (the keys of two steps back: every member has read that decision before voting on this one)
  if (id_ == members_.ids.front() && step > 2) {
    const std::string old = key(generation, "s" + std::to_string(step - 2));
    store_->deleteKey(old + "/ok");
    store_->deleteKey(old + "/decision");
  }
  return committed;
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
    Membership m{generation, joined, store_->add("elastic/failures", 0)};
    store_->compareSet(members_key, {}, bytes(encode(m)));
    return true;
  });
  return decode(generation, text(store_->get(members_key)));
}

comm::ProcessGroup Elastic::regroup(int64_t next_step) {
  // (a recovery that failed itself, e.g. a member lost while the group was made, used its number)
  const int generation = ++last_generation_;
  store_->set(key(generation, "join/" + std::to_string(id_)), bytes(std::to_string(next_step)));
  Membership m = decide(generation);
  const auto me = std::find(m.ids.begin(), m.ids.end(), id_);
  if (me == m.ids.end()) {
    throw std::runtime_error("rank " + std::to_string(id_) + " was left out of generation " + std::to_string(generation) +
                             " (members: ranks " + join_ids(m.ids) + " of the first generation): it joined after the "
                             "others decided (--elastic-join-timeout)");
  }
  for (int id : m.ids) {
    const int64_t theirs = std::stoll(text(store_->get(key(generation, "join/" + std::to_string(id)))));
    if (theirs != next_step) {
      throw std::runtime_error("rank " + std::to_string(id_) + " would redo step " + std::to_string(next_step + 1) +
                               " but rank " + std::to_string(id) + " step " + std::to_string(theirs + 1) +
                               ": the survivors disagree on the last committed step (a bug: please report it)");
    }
  }
  const int rank = static_cast<int>(me - m.ids.begin());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(key(generation, "group"), store_);
  comm::ProcessGroup next =
      comm::ProcessGroup::create(kind_, prefixed, rank, static_cast<int>(m.ids.size()), timeout_, {}, device_);
  next.abort_signal()->arm();
  std::lock_guard<std::mutex> lock(mu_);
  retired_.push_back(group_);
  group_ = next;
  members_ = std::move(m);
  return next;
}

}  // namespace dtrain::train
