#include "dtrain/comm/process_group.h"

#include "dtrain/comm/barrier.h"

#include <atomic>
#include <cstdlib>
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
  bool check_collectives = false;
  // Subgroups created from this group so far: identical on every member, because every member
  // must create subgroups in the same order (as torch.distributed.new_group requires).
  std::shared_ptr<std::atomic<int>> children = std::make_shared<std::atomic<int>>(0);
};

namespace {

bool is_loopback(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> gloo_device() {
  // Same rules as torch.distributed: GLOO_SOCKET_IFNAME picks the interface; otherwise the
  // host name. On one machine (MASTER_ADDR on loopback, or none) we stay on loopback.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  const char* addr = std::getenv("MASTER_ADDR");
  if (!addr || is_loopback(addr)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

bool debug_enabled() {
  const char* v = std::getenv("DTRAIN_DEBUG");
  return v && *v && std::string(v) != "0" && std::string(v) != "OFF";
}

}  // namespace

ProcessGroup ProcessGroup::create(BackendKind kind, c10::intrusive_ptr<c10d::Store> store, int rank,
                                  int size, std::chrono::milliseconds timeout,
                                  std::vector<int> global_ranks, c10::Device device) {
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
    throw CommError(where + "creating the " + to_string(kind) + " process group (rank " +
                    std::to_string(rank) + " of " + std::to_string(size) + ") failed: " + e.what());
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

ProcessGroup ProcessGroup::split(const std::vector<std::vector<int>>& partition) const {
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
  ProcessGroup child = create(s.kind, store, my_rank, static_cast<int>(members.size()), s.timeout,
                              std::move(globals), s.device);
  child.state_->name = name;
  child.state_->check_collectives = s.check_collectives;
  return child;  // create() ended with a barrier: every member is connected
}

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks) const {
  TORCH_CHECK(!ranks.empty(), describe(), " new_group: the rank list is empty");
  return split({ranks});
}

}  // namespace dtrain::comm
