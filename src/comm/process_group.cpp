#include "dtrain/comm/process_group.h"

#include "dtrain/comm/barrier.h"

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef DTRAIN_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace dtrain::comm {

struct ProcessGroup::State {
  BackendKind kind = BackendKind::Gloo;
  c10::intrusive_ptr<compat::Backend> backend;
  c10::intrusive_ptr<c10d::Store> store;  // the store this group's members share (prefixed)
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout = kDefaultTimeout;
  std::vector<int> global_ranks;
  c10::Device device = c10::Device(c10::kCPU);
  std::string name = "world";  // hierarchical: subgroups are "<parent>/<n>"
  std::string label;           // (empty: the name)
  std::vector<int> member_nodes;
  bool check_collectives = false;
  // Subgroups created from this group so far: identical on every member, because every member
  // must create subgroups in the same order (as torch.distributed.new_group requires).
  std::shared_ptr<std::atomic<int>> children = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<uint64_t>> sequence = std::make_shared<std::atomic<uint64_t>>(0);
  std::shared_ptr<AbortSignal> abort = std::make_shared<AbortSignal>();  // (shared with subgroups)
  State() = default;
  State(const State&) = default;             // (repoint: the state it replaces, kept)
  State& operator=(const State&) = default;  // (repoint: every handle's state becomes the new group's)
  // An aborted group is never destroyed (Design note [aborting a group's waits], abort.h): its
  // backend may still run an abandoned operation that waits for a peer which moved on, and
  // ~ProcessGroupGloo would wait with it (a rank left out of an elastic job, or the members
  // dropping the old plan's subgroups, would hang until that peer's process ends). Its threads and
  // sockets stay, idle, until the process exits.
  ~State() {
    if (abort && abort->aborted() && backend) (void)backend.release();
  }
};

namespace {

bool is_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1";
}

// This machine's address on the route to `host` (as NCCL picks its interface): a UDP socket
// "connected" to it sends nothing but makes the kernel choose the source address. "" on failure.
std::string address_routing_to(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) return "";
  std::string out;
  for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char name[NI_MAXHOST] = {};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, name, sizeof(name), nullptr, 0, NI_NUMERICHOST) == 0) {
      out = name;
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return out;
}

// Design note [SIGPIPE]: Gloo writes to its peers' sockets without MSG_NOSIGNAL, so a write to a
// peer that just died raises SIGPIPE, whose default action kills this process too ("killed by
// signal 13" instead of an error naming the lost peer; under --elastic the survivors died with the
// rank they should have outlived: the soak benchmark found it). Python ignores SIGPIPE from its
// start, which is why PyTorch's users never see it; a C++ program does not. So the first Gloo group
// sets SIGPIPE to SIG_IGN when it is still SIG_DFL (a handler or disposition the program chose is
// left alone): the write fails with EPIPE and the collective with a CommError.
void ignore_sigpipe() {
  static const bool once = [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)once;
}

// How this process's Gloo devices are made (once per process; every group uses the same).
struct GlooEndpoint {
  std::string address;  // what this rank advertises to its peers ("" for GLOO_SOCKET_IFNAME's interface)
  std::string how;      // for messages: how it was chosen and what overrides it
};

const GlooEndpoint& gloo_endpoint() {
  static const GlooEndpoint e = [] {
    GlooEndpoint g;
    // GLOO_SOCKET_IFNAME picks the interface, as in torch.distributed. On one machine (MASTER_ADDR
    // on loopback, or none) ranks stay on loopback. Otherwise the host name would decide, which on
    // many machines resolves to 127.0.1.1 (Debian's /etc/hosts) and makes every rank advertise
    // loopback to the other nodes: take the address that routes to MASTER_ADDR instead.
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      g.how = std::string("the interface GLOO_SOCKET_IFNAME=") + ifname;
      return g;
    }
    const char* master = std::getenv("MASTER_ADDR");
    if (!master || is_loopback(master)) {
      g.address = "127.0.0.1";
      g.how = "loopback (MASTER_ADDR is on this machine)";
      return g;
    }
    g.address = address_routing_to(master);
    TORCH_CHECK(!g.address.empty(), "gloo: no route from this machine to MASTER_ADDR ", master,
                " (resolving or routing to it failed); check MASTER_ADDR, or set GLOO_SOCKET_IFNAME to the interface "
                "that reaches the other nodes");
    g.how = "the address that routes to MASTER_ADDR " + std::string(master) + "; GLOO_SOCKET_IFNAME=<interface> "
            "chooses another";
    const char* local_rank = std::getenv("LOCAL_RANK");
    if (!local_rank || std::string(local_rank) == "0") {
      std::fprintf(stderr, "dtrain: gloo on this node uses %s (%s)\n", g.address.c_str(), g.how.c_str());
      std::fflush(stderr);
    }
    return g;
  }();
  return e;
}

std::shared_ptr<::gloo::transport::Device> gloo_device() {
  const GlooEndpoint& e = gloo_endpoint();
  if (e.address.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(std::getenv("GLOO_SOCKET_IFNAME"));
  return c10d::ProcessGroupGloo::createDeviceForHostname(e.address);
}

// This process's node as the launcher numbered it (ProcessGroup::member_nodes); under a launcher
// that says nothing, a number made from the host's name (the same on every process of a machine).
int node_from_env() {
  for (const char* var : {"GROUP_RANK", "SLURM_NODEID"}) {
    const char* v = std::getenv(var);
    if (v && *v) {
      try {
        return std::max(0, std::stoi(v));
      } catch (const std::exception&) {  // (not a number: the next one, or the host's name)
      }
    }
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) return 0;
  return static_cast<int>(std::hash<std::string>()(host) & 0x3fffffff);
}

// Every member's node, through the group's store: each sets its own key, rank 0 reads them all
// and publishes the list, the others read that (3 W store requests, not W x W).
std::vector<int> exchange_nodes(c10d::Store& store, int rank, int size, int node) {
  if (size == 1) return {node};
  auto text = [](const std::string& t) { return std::vector<uint8_t>(t.begin(), t.end()); };
  store.set("node/" + std::to_string(rank), text(std::to_string(node)));
  if (rank == 0) {
    std::string all;
    for (int r = 0; r < size; ++r) {
      const std::vector<uint8_t> v = store.get("node/" + std::to_string(r));
      all += (r ? "," : "") + std::string(v.begin(), v.end());
    }
    store.set("nodes", text(all));
  }
  const std::vector<uint8_t> v = store.get("nodes");
  std::vector<int> nodes;
  std::stringstream in(std::string(v.begin(), v.end()));
  for (std::string item; std::getline(in, item, ',');) nodes.push_back(std::stoi(item));
  TORCH_CHECK(static_cast<int>(nodes.size()) == size, "the members' nodes: ", nodes.size(), " for ", size, " members");
  return nodes;
}

bool debug_enabled() {
  const char* v = std::getenv("DTRAIN_DEBUG");
  return v && *v && std::string(v) != "0" && std::string(v) != "OFF";
}

}  // namespace

ProcessGroup ProcessGroup::create(BackendKind kind, c10::intrusive_ptr<c10d::Store> store, int rank,
                                  int size, std::chrono::milliseconds timeout,
                                  std::vector<int> global_ranks, c10::Device device, int node) {
  return make(kind, std::move(store), rank, size, timeout, std::move(global_ranks), device, node, {});
}

ProcessGroup ProcessGroup::make(BackendKind kind, c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                std::chrono::milliseconds timeout, std::vector<int> global_ranks, c10::Device device,
                                int node, std::vector<int> nodes) {
  TORCH_CHECK(size >= 1, "ProcessGroup: world size must be >= 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "ProcessGroup: rank ", rank, " is outside [0, ", size, ")");
  TORCH_CHECK(store, "ProcessGroup: a store is required");
  if (global_ranks.empty()) {
    for (int i = 0; i < size; ++i) global_ranks.push_back(i);
  }
  TORCH_CHECK(static_cast<int>(global_ranks.size()) == size, "ProcessGroup: ", global_ranks.size(),
              " global ranks given for a group of size ", size);
  auto s = std::make_shared<State>();
  s->kind = kind;
  s->store = store;
  s->rank = rank;
  s->size = size;
  s->timeout = timeout;
  s->global_ranks = std::move(global_ranks);
  s->device = device;
  s->check_collectives = debug_enabled();
  const std::string where = "[dtrain rank " + std::to_string(s->global_ranks[rank]) + "] ";
  try {
    switch (kind) {
      case BackendKind::Gloo: {
        ignore_sigpipe();
        auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
        opts->devices.push_back(gloo_device());
        s->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
        break;
      }
      case BackendKind::Nccl: {
#ifdef DTRAIN_WITH_NCCL
        auto opts = c10d::ProcessGroupNCCL::Options::create();
        opts->timeout = timeout;
        s->backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
        break;
#else
        TORCH_CHECK(false, "the NCCL backend needs a libtorch built with CUDA and NCCL; this one "
                           "is CPU-only: use backend \"gloo\"");
#endif
      }
      case BackendKind::Mpi:
        TORCH_CHECK(false, "the MPI backend needs a libtorch built with MPI; use \"gloo\"");
    }
  } catch (const std::exception& e) {
    std::string hint;
    if (kind == BackendKind::Gloo) {
      GlooEndpoint g;
      try {
        g = gloo_endpoint();
      } catch (const std::exception&) {  // (the failure itself: e says it)
      }
      if (!g.how.empty()) hint = std::string(". This rank advertised ") + (g.address.empty() ? "its interface's address" : g.address) +
             " to its peers (" + g.how + "); if the ranks cannot reach each other there, set GLOO_SOCKET_IFNAME "
             "to the interface that connects the nodes";
    }
    throw CommError(where + "creating the " + to_string(kind) + " process group (rank " +
                    std::to_string(rank) + " of " + std::to_string(size) + ") failed: " + e.what() + hint);
  }
  try {
    s->member_nodes = !nodes.empty() ? std::move(nodes) : exchange_nodes(*store, rank, size, node >= 0 ? node : node_from_env());
  } catch (const std::exception& e) {
    throw CommError(where + "creating the process group (rank " + std::to_string(rank) + " of " + std::to_string(size) +
                    "): the members' nodes could not be exchanged through the store: " + e.what());
  }
  ProcessGroup pg(std::move(s));
  // As torch.distributed's store-based barrier after creating a group: every member has finished
  // connecting before anyone uses (or drops) the group. Without it a member that returns and
  // destroys the group at once closes a connection another member is still setting up ("creating
  // the gloo process group ... Connection closed by peer"), as a test whose ranks did no
  // collective showed under load.
  if (size > 1) barrier(pg);
  return pg;
}

const ProcessGroup::State& ProcessGroup::state() const {
  TORCH_CHECK(state_, "this ProcessGroup handle is empty: this rank is not a member of the group");
  return *state_;
}

int ProcessGroup::rank() const { return state().rank; }
int ProcessGroup::size() const { return state().size; }
BackendKind ProcessGroup::backend_kind() const { return state().kind; }
std::chrono::milliseconds ProcessGroup::timeout() const { return state().timeout; }
const std::vector<int>& ProcessGroup::global_ranks() const { return state().global_ranks; }
c10::Device ProcessGroup::device() const { return state().device; }
compat::Backend& ProcessGroup::backend() const { return *state().backend; }
const c10::intrusive_ptr<c10d::Store>& ProcessGroup::store() const { return state().store; }
bool ProcessGroup::checks_collectives() const { return state().check_collectives; }
const std::shared_ptr<AbortSignal>& ProcessGroup::abort_signal() const { return state().abort; }
void ProcessGroup::share_abort_signal(const ProcessGroup& parent) {
  TORCH_CHECK(state_ && parent.state_, "share_abort_signal: not a member of both groups");
  state_->abort = parent.state_->abort;
}

ProcessGroup ProcessGroup::repoint(const ProcessGroup& fresh) {
  TORCH_CHECK(state_ && fresh.state_, "ProcessGroup::repoint: this rank is not a member of both groups");
  TORCH_CHECK(state_ != fresh.state_, describe(), " ProcessGroup::repoint: the group is already this one");
  TORCH_CHECK(fresh.size() == size() && fresh.rank() == rank(), describe(), " ProcessGroup::repoint: the new group has "
              "this rank at ", fresh.rank(), " of ", fresh.size(), ", not ", rank(), " of ", size(), ": a group is "
              "re-pointed only at one of the same ranks in the same order (Design note [a group re-pointed])");
  auto was = std::make_shared<State>(*state_);
  *state_ = *fresh.state_;
  return ProcessGroup(std::move(was));
}

const std::string& ProcessGroup::name() const { return state().name; }
const std::string& ProcessGroup::label() const { return state().label.empty() ? state().name : state().label; }
const std::vector<int>& ProcessGroup::member_nodes() const { return state().member_nodes; }

uint64_t ProcessGroup::next_sequence() const { return ++*state().sequence; }

std::string ProcessGroup::describe() const {
  if (!state_) return "[dtrain non-member]";
  std::ostringstream os;
  os << "[dtrain rank " << state_->global_ranks[state_->rank];
  if (state_->name == "world") {
    os << "/" << state_->size << "]";
  } else {
    os << ", group " << state_->name << " rank " << state_->rank << "/" << state_->size << "]";
  }
  return os.str();
}

ProcessGroup ProcessGroup::split(const std::vector<std::vector<int>>& partition, const std::string& label) const {
  const State& s = state();
  const int index = s.children->fetch_add(1);
  std::vector<int> seen(s.size, 0);
  int mine = -1;
  for (size_t p = 0; p < partition.size(); ++p) {
    TORCH_CHECK(!partition[p].empty(), describe(), " split: part ", p, " is empty");
    for (int r : partition[p]) {
      TORCH_CHECK(r >= 0 && r < s.size, describe(), " split: rank ", r, " is outside [0, ", s.size, ")");
      TORCH_CHECK(!seen[r]++, describe(), " split: rank ", r, " appears more than once");
      if (r == s.rank) mine = static_cast<int>(p);
    }
  }
  if (mine < 0) return ProcessGroup();  // not in any part (allowed for new_group)
  const auto& members = partition[mine];
  int my_rank = 0;
  std::vector<int> globals;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == s.rank) my_rank = static_cast<int>(i);
    globals.push_back(s.global_ranks[members[i]]);
  }
  const std::string name = (s.name == "world" ? std::string() : s.name + "/") +
                           std::to_string(index) + "." + std::to_string(mine);
  auto store = c10::make_intrusive<c10d::PrefixStore>("group/" + name, s.store);
  std::vector<int> nodes;  // (the members' nodes, from the parent's: nothing to exchange)
  for (int r : members) nodes.push_back(s.member_nodes[static_cast<size_t>(r)]);
  ProcessGroup child = make(s.kind, store, my_rank, static_cast<int>(members.size()), s.timeout, std::move(globals),
                            s.device, -1, std::move(nodes));
  child.state_->name = name;
  child.state_->label = label;
  child.state_->check_collectives = s.check_collectives;
  child.state_->abort = s.abort;
  return child;  // create() ended with a barrier: every member is connected
}

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks) const {
  TORCH_CHECK(!ranks.empty(), describe(), " new_group: the rank list is empty");
  return split({ranks});
}

}  // namespace dtrain::comm
