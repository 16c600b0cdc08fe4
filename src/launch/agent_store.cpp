#include "dtrain/launch/agent_store.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/compat.h"
#include "dtrain/launch/signals.h"

namespace dtrain::launch {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

const std::string kAbortKey = "dtrun/abort";

std::string rdzv_key(int round, const std::string& rest) {
  return "dtrun/rdzv/" + std::to_string(round) + "/" + rest;
}
std::string round_key(int round, const std::string& rest) {
  return "dtrun/round/" + std::to_string(round) + "/" + rest;
}

// One non-blocking connect attempt with a 1 s limit.
bool try_connect(const addrinfo* ai, std::string* error) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) {
    *error = std::strerror(errno);
    return false;
  }
  bool ok = false;
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
    ok = true;
  } else if (errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 1000) == 1) {
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      ok = err == 0;
      if (!ok) *error = std::strerror(err);
    } else {
      *error = "connection attempt timed out";
    }
  } else {
    *error = std::strerror(errno);
  }
  close(fd);
  return ok;
}

}  // namespace

// ---- RoundFailure ----

std::string RoundFailure::encode() const {
  return std::to_string(node) + "\n" + std::to_string(exit_code) + "\n" + (membership ? "2" : restartable ? "1" : "0") + "\n" + what;
}

RoundFailure RoundFailure::decode(const std::string& t) {
  RoundFailure f;
  std::istringstream in(t);
  std::string node, code, restartable;
  std::getline(in, node);
  std::getline(in, code);
  std::getline(in, restartable);
  std::getline(in, f.what, '\0');
  try {
    f.node = std::stoi(node);
    f.exit_code = std::stoi(code);
  } catch (const std::exception&) {
    throw LaunchError("malformed failure record in the agent store: '" + t + "'");
  }
  f.restartable = restartable == "1" || restartable == "2";
  f.membership = restartable == "2";
  return f;
}

// ---- wait_for_listener ----

bool wait_for_listener(const std::string& host, int port, milliseconds timeout,
                       const std::function<bool()>& interrupted, std::string* last_error) {
  const auto deadline = Clock::now() + timeout;
  std::string error;
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0) {
      error = std::string("cannot resolve '") + host + "': " + gai_strerror(rc);
    } else {
      bool ok = false;
      for (addrinfo* ai = res; ai && !ok; ai = ai->ai_next) ok = try_connect(ai, &error);
      freeaddrinfo(res);
      if (ok) return true;
    }
    if (last_error) *last_error = error;
    if (interrupted && interrupted()) return false;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(100));
  }
}

// ---- AgentStore ----

AgentStore::AgentStore(const LaunchOptions& options, const std::function<bool()>& interrupted)
    : options_(options), workers_per_node_(options.nproc_per_node) {
  for (int k = 0; k < options.nnodes; ++k) watched_.push_back(k);
  const auto timeout = milliseconds(static_cast<int64_t>(options.rdzv_timeout_s * 1000));
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(options.master_port);
  o.isServer = options.node_rank == 0;
  o.numWorkers = c10::nullopt;
  o.waitWorkers = false;
  o.timeout = timeout;
  o.multiTenant = false;
  if (o.isServer) {
    // The server runs in a process of its own (Design note [store server process]), kept to
    // --master-addr (Design note [control plane]); this process is one of its clients.
    try {
      server_ = std::make_unique<StoreServer>(options.master_addr, options.master_port, timeout, interrupted);
    } catch (const LaunchError& e) {
      if (interrupted && interrupted()) throw;
      throw LaunchError("cannot host the agent store on port " + std::to_string(options.master_port) + " (" +
                        e.what() + ")" +
                        (options.master_port != 0 ? "; is the port in use? --master-port 0 picks a free one" : "") +
                        "; node 0 listens on --master-addr " + options.master_addr +
                        " only, so it must be an address of this machine");
    }
    o.port = static_cast<std::uint16_t>(server_->port());
    o.isServer = false;
  }
  const std::string where = options.master_addr + ":" + std::to_string(o.port);
  if (!server_) {
    std::string error;
    if (!wait_for_listener(options.master_addr, options.master_port, timeout, interrupted, &error)) {
      if (interrupted && interrupted()) throw LaunchError("interrupted while waiting for node 0's agent store");
      std::ostringstream s;
      s << "cannot reach the agent store of node 0 at " << where << " within " << options.rdzv_timeout_s
        << " s (" << error << "); is dtrun running there with --node-rank 0 and the same --master-port?";
      throw LaunchError(s.str());
    }
  }
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  try {
    // The client's threads (2.x) must never run dtrun's signal handlers.
    with_signals_blocked([&] { tcp = compat::make_tcp_store(options.master_addr, o); });
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    throw LaunchError("cannot connect to the agent store at " + where + " (" + what + ")");
  }
  port_ = tcp->getPort();
  // Every key under the job's secret (Design note [control plane]).
  if (options.job_secret.empty()) {
    store_ = tcp;
  } else {
    store_ = c10::make_intrusive<c10d::PrefixStore>("job-" + options.job_secret, tcp);
  }
}

AgentStore::~AgentStore() = default;

int AgentStore::joined_count(int round) { return static_cast<int>(store_->add(rdzv_key(round, "joined"), 0)); }

namespace {
// "nproc-per-node=P rest": (P, rest).
std::pair<int, std::string> split_nproc(const std::string& config) {
  const auto space = config.find(' ');
  const std::string head = config.substr(0, space), tag = "nproc-per-node=";
  const int nproc = head.rfind(tag, 0) == 0 ? std::atoi(head.c_str() + tag.size()) : -1;
  return {nproc, space == std::string::npos ? std::string() : config.substr(space + 1)};
}
}  // namespace

std::pair<std::vector<int>, std::vector<std::string>> AgentStore::joined_nodes(int round) {
  std::pair<std::vector<int>, std::vector<std::string>> out;
  const std::string mine = config_string();
  const auto [my_nproc, my_rest] = split_nproc(mine);
  // (node ranks 1..MAX under a coordinator node 0)
  for (int k = 0; k <= options_.nnodes - (options_.coordinator() ? 0 : 1); ++k) {
    const std::string key = rdzv_key(round, "config/" + std::to_string(k));
    if (!store_->check({key})) continue;
    const std::string theirs = text(store_->get(key));
    const auto [nproc, rest] = split_nproc(theirs);
    if (options_.coordinator() && workers_per_node_ == 0 && rest == my_rest && nproc > 0) {
      workers_per_node_ = nproc;  // (and told to the nodes that check their settings later)
      store_->set("dtrun/workers-per-node", bytes(std::to_string(nproc)));
    }
    if (rest == my_rest && nproc == workers_per_node_) {
      out.first.push_back(k);
    } else {
      out.second.push_back("node " + std::to_string(k) + " was started with different settings (" + theirs +
                           ") than " + (options_.coordinator() ? "the training nodes (nproc-per-node=" +
                                                                     std::to_string(workers_per_node_) + " " + my_rest + ")"
                                                               : "node 0 (" + mine + ")"));
    }
  }
  return out;
}

void AgentStore::close_round(int round, const std::vector<int>& members, int restarts) {
  std::string list;
  for (int k : members) list += (list.empty() ? "" : ",") + std::to_string(k);
  store_->set(rdzv_key(round, "restarts"), bytes(std::to_string(restarts)));
  store_->set(rdzv_key(round, "members"), bytes(list));
  store_->set("dtrun/newest", bytes(std::to_string(round)));
}

int AgentStore::restarts_of(int round) {
  const std::string key = rdzv_key(round, "restarts");
  return store_->check({key}) ? std::stoi(text(store_->get(key))) : 0;
}

void AgentStore::publish_settings() { store_->set("dtrun/settings", bytes(config_string())); }

std::optional<std::string> AgentStore::settings_mismatch() {
  if (!store_->check({"dtrun/settings"})) return std::nullopt;
  const std::string theirs = text(store_->get("dtrun/settings")), mine = config_string();
  const auto [node0_nproc, node0_rest] = split_nproc(theirs);
  if (node0_nproc != 0 && options_.node_rank == options_.nnodes) {
    return "--node-rank " + std::to_string(options_.node_rank) + " is for a job whose node 0 is a coordinator "
           "(--nproc-per-node 0), and node 0 trains here (" + theirs + "): number the nodes 0.." +
           std::to_string(options_.nnodes - 1);
  }
  if (node0_nproc == 0 && store_->check({"dtrun/workers-per-node"})) {  // (a coordinator learned the nodes')
    const std::string nproc = text(store_->get("dtrun/workers-per-node"));
    if (nproc != std::to_string(options_.nproc_per_node))
      return "the training nodes run --nproc-per-node " + nproc + " and this node " + std::to_string(options_.nproc_per_node) +
             " (node 0 coordinates); every training node needs the same";
  }
  if (node0_nproc == 0 ? node0_rest == split_nproc(mine).second : theirs == mine) return std::nullopt;
  return "node 0 was started with different settings (" + theirs + ") than this node (" + mine +
         "); every node needs the same values" + (node0_nproc == 0 ? " (node 0 coordinates: its nproc-per-node 0 is its own)" : "");
}

std::optional<std::vector<int>> AgentStore::members(int round) {
  const std::string key = rdzv_key(round, "members");
  if (!store_->check({key})) return std::nullopt;
  std::vector<int> out;
  std::istringstream in(text(store_->get(key)));
  for (std::string k; std::getline(in, k, ',');) out.push_back(std::stoi(k));
  return out;
}

std::optional<int> AgentStore::newest_round() {
  if (!store_->check({"dtrun/newest"})) return std::nullopt;
  return std::stoi(text(store_->get("dtrun/newest")));
}

std::string AgentStore::config_string() const {
  const std::string nnodes = (options_.elastic() ? std::to_string(options_.min_nodes) + ":" : "") + std::to_string(options_.nnodes);
  return "nproc-per-node=" + std::to_string(options_.nproc_per_node) + " nnodes=" + nnodes +
         " max-restarts=" + std::to_string(options_.max_restarts) + " rdzv-id=" + options_.run_id +
         (options_.keep_survivors ? " keep-survivors" : "");
}

void AgentStore::join(int round) {
  const std::string node = std::to_string(options_.node_rank);
  if (store_->add(rdzv_key(round, "claim/" + node), 1) > 1)
    throw LaunchError("two agents joined with --node-rank " + node + "; every node needs its own node rank");
  store_->set(rdzv_key(round, "config/" + node), bytes(config_string()));
  store_->deleteKey("dtrun/exit/" + node);  // (a node that comes back: not the one that left)
  store_->add("dtrun/hb/" + node, 1);  // from now on this node is watched by the others
  store_->add(rdzv_key(round, "joined"), 1);
}

bool AgentStore::all_joined(int round) {
  if (store_->add(rdzv_key(round, "joined"), 0) < options_.nnodes) return false;
  const std::string mine = config_string();
  for (int k = 0; k < options_.nnodes; ++k) {
    if (k == options_.node_rank) continue;
    std::string theirs = text(store_->get(rdzv_key(round, "config/" + std::to_string(k))));
    if (theirs != mine)
      throw LaunchError("node " + std::to_string(k) + " was started with different settings (" + theirs +
                        ") than this node (" + mine + "); every node needs the same values");
  }
  return true;
}

std::vector<int> AgentStore::missing_nodes(int round) {
  std::vector<int> missing;
  for (int k = 0; k < options_.nnodes; ++k)
    if (!store_->check({rdzv_key(round, "config/" + std::to_string(k))})) missing.push_back(k);
  return missing;
}

RoundFailure AgentStore::report_failure(int round, const RoundFailure& failure) {
  // A failure that must not be restarted (a stop request, a lost agent) ends the whole job: it
  // also goes to dtrun/abort, which overrides every round's record.
  if (!failure.restartable) store_->compareSet(kAbortKey, {}, bytes(failure.encode()));
  auto current = store_->compareSet(round_key(round, "failure"), {}, bytes(failure.encode()));
  if (auto abort = this->failure(round)) return *abort;
  return RoundFailure::decode(text(current));
}

std::optional<RoundFailure> AgentStore::failure(int round) {
  if (store_->check({kAbortKey})) return RoundFailure::decode(text(store_->get(kAbortKey)));
  const std::string key = round_key(round, "failure");
  if (!store_->check({key})) return std::nullopt;
  return RoundFailure::decode(text(store_->get(key)));
}

std::string AgentStore::elastic_prefix(int round) const {
  // The workers' keys (comm::init_process_group under the agent store: "<job>/worker/attempt_<n>",
  // then "dtrain"); this store is already under "job-<secret>" when there is a secret.
  return std::string(options_.job_secret.empty() ? "/" : "") + "worker/attempt_" + std::to_string(round) + "/dtrain/elastic/";
}

bool AgentStore::marked_dead(int round, int rank) {
  return store_->check({elastic_prefix(round) + "dead/" + std::to_string(rank)});
}

std::optional<std::string> AgentStore::restart_requested(int round) {
  const std::string key = elastic_prefix(round) + "restart";
  if (!store_->check({key})) return std::nullopt;
  return text(store_->get(key));
}

void AgentStore::declare_dead(int round, int rank, const std::string& why) {
  const std::string workers = elastic_prefix(round);
  if (store_->check({workers + "dead/" + std::to_string(rank)})) return;  // (declared before: no second failure)
  // (the count first: a decider that sees the rank dead reads a baseline that already has it)
  const int64_t n = store_->add(workers + "failures", 1);
  store_->set(workers + "why/" + std::to_string(n), bytes(why));
  store_->set(workers + "dead/" + std::to_string(rank), bytes("1"));
}

void AgentStore::admit(int round, int node, const std::vector<int>& ids) {
  std::string v = std::to_string(round);
  for (int id : ids) v += " " + std::to_string(id);
  const std::string k = std::to_string(node);
  store_->set(rdzv_key(round + 1, "admit/" + k), bytes(v));
  // (its join of round + 1 is undone: nobody waits for that round now, and the node may join it
  // again, should it be lost and come back)
  store_->deleteKey(rdzv_key(round + 1, "config/" + k));
  store_->add(rdzv_key(round + 1, "claim/" + k), -1);
  store_->add(rdzv_key(round + 1, "joined"), -1);
}

void AgentStore::forget_admission(int round, int node) {
  store_->deleteKey(rdzv_key(round + 1, "admit/" + std::to_string(node)));
}

std::optional<std::pair<int, std::vector<int>>> AgentStore::admission(int next_round) {
  const std::string key = rdzv_key(next_round, "admit/" + std::to_string(options_.node_rank));
  if (!store_->check({key})) return std::nullopt;
  std::istringstream in(text(store_->get(key)));
  store_->deleteKey(key);  // (read once: a later join of this node is a new one)
  std::pair<int, std::vector<int>> out;
  in >> out.first;
  for (int id; in >> id;) out.second.push_back(id);
  return out;
}

int AgentStore::next_replacement() { return static_cast<int>(store_->add("dtrun/replacements", 1)); }

void AgentStore::record_replacement(int node, int id) {
  const int64_t n = store_->add("dtrun/node/" + std::to_string(node) + "/replacements", 1);
  store_->set("dtrun/node/" + std::to_string(node) + "/replacement/" + std::to_string(n), bytes(std::to_string(id)));
}

std::vector<int> AgentStore::replacements_on(int node) {
  std::vector<int> ids;
  const std::string base = "dtrun/node/" + std::to_string(node) + "/replacement";
  const int64_t n = store_->add(base + "s", 0);
  for (int64_t k = 1; k <= n; ++k) {
    const std::string key = base + "/" + std::to_string(k);
    if (store_->check({key})) ids.push_back(std::stoi(text(store_->get(key))));
  }
  return ids;
}

std::vector<int> AgentStore::not_finished(int round) {
  std::vector<int> out;
  for (int k : watched_) {
    const std::string node = std::to_string(k);
    if (!store_->check({round_key(round, "done/" + node)}) && !store_->check({"dtrun/exit/" + node})) out.push_back(k);
  }
  return out;
}

void AgentStore::report_done(int round, int exit_code) {
  store_->set(round_key(round, "done/" + std::to_string(options_.node_rank)), bytes(std::to_string(exit_code)));
  store_->add(round_key(round, "done"), 1);
}

int AgentStore::finished_code(int round) {
  int code = -1;
  for (int k : watched_) {
    const std::string key = round_key(round, "done/" + std::to_string(k));
    if (!store_->check({key})) continue;
    const int c = std::atoi(text(store_->get(key)).c_str());
    if (c == 0 || code == -1) code = c;
    if (code == 0) return 0;
  }
  return code == -1 ? 0 : code;
}

int AgentStore::done_count(int round) { return static_cast<int>(store_->add(round_key(round, "done"), 0)); }

std::vector<int> AgentStore::heartbeat(milliseconds timeout) {
  std::vector<int> stale;
  const auto now = Clock::now();
  if (now - last_beat_ < std::chrono::seconds(1)) return stale;
  last_beat_ = now;
  store_->add("dtrun/hb/" + std::to_string(options_.node_rank), 1);
  for (int k : watched_) {
    if (k == options_.node_rank) continue;
    const std::string node = std::to_string(k);
    if (store_->check({"dtrun/exit/" + node})) continue;
    int64_t value = store_->add("dtrun/hb/" + node, 0);
    if (value == 0) continue;  // not joined yet: the rendezvous deals with absent nodes
    Beat& b = beats_[k];
    if (value != b.value) {
      b.value = value;
      b.changed = now;
    } else if (now - b.changed > timeout) {
      stale.push_back(k);
    }
  }
  return stale;
}

void AgentStore::arrive_exit() { store_->set("dtrun/exit/" + std::to_string(options_.node_rank), bytes("1")); }

std::vector<int> AgentStore::not_yet_exited() {
  std::vector<int> out;
  for (int k : watched_)
    if (!store_->check({"dtrun/exit/" + std::to_string(k)})) out.push_back(k);
  return out;
}

}  // namespace dtrain::launch
