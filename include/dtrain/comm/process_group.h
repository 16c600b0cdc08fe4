#pragma once
// A process-group handle over a c10d backend (Gloo on CPU, NCCL on CUDA).
//
// ProcessGroup is a cheap, copyable value (shared state inside). The collectives are free
// functions, one header each (all_reduce.h, broadcast.h, ...), that take a ProcessGroup.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dtrain/comm/abort.h"
#include "dtrain/compat.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm {

class ProcessGroup {
 public:
  // An empty handle: what new_group() returns on ranks that are not members.
  ProcessGroup() = default;

  // Creates a backend of `kind` over `store` (every member calls this with the same store).
  // `global_ranks[i]` is the world rank of group rank i; empty means ranks 0..size-1. `node`: the
  // machine this member runs on (member_nodes()); -1 reads it from the environment.
  static ProcessGroup create(BackendKind kind, c10::intrusive_ptr<c10d::Store> store, int rank,
                             int size, std::chrono::milliseconds timeout = kDefaultTimeout,
                             std::vector<int> global_ranks = {},
                             c10::Device device = c10::Device(c10::kCPU), int node = -1);

  bool is_member() const { return state_ != nullptr; }
  int rank() const;
  int size() const;
  BackendKind backend_kind() const;
  std::chrono::milliseconds timeout() const;
  // World rank of each group rank.
  const std::vector<int>& global_ranks() const;
  // The device collectives of this group work on (CPU for Gloo, cuda:<local rank> for NCCL).
  c10::Device device() const;

  compat::Backend& backend() const;
  const c10::intrusive_ptr<c10d::Store>& store() const;

  // Subgroup of this group's ranks (indices into this group). Like torch.distributed.new_group,
  // every member of this group must call it, in the same order; non-members get an empty handle.
  ProcessGroup new_group(const std::vector<int>& ranks) const;
  // Partitions this group: every rank appears in exactly one part; each rank gets its own part.
  // Every member must call it with the same partition (used by hybrid sharding: shard x replicate).
  // `label`: the parts' role, as the traffic counters name them (label()).
  ProcessGroup split(const std::vector<std::vector<int>>& partition, const std::string& label = "") const;

  // "[dtrain rank 1/3]" (world rank / group size, and the group's name for subgroups).
  std::string describe() const;
  // "world", or "<parent>/<n>" for the n-th subgroup made from a parent (the same on every member).
  const std::string& name() const;
  // What the traffic counters call this group (comm/traffic.h): the role split() was given
  // ("shard", "replicate", "tensor", ...), else its name.
  const std::string& label() const;
  // The node (machine) of each member, by group rank: what each member's environment says
  // (GROUP_RANK, set by dtrun and torchrun; SLURM_NODEID under srun; else a number made from the
  // host's name), exchanged through the store when the group is created. The traffic counters split bytes sent within and across
  // nodes by it.
  const std::vector<int>& member_nodes() const;
  // The next operation's sequence number in this group (1, 2, ...; the flight recorder's).
  uint64_t next_sequence() const;

  // When on (DTRAIN_DEBUG=1 in the environment at creation), every collective first checks with
  // a small all-gather that all ranks called the same operation with the same sizes, and reports
  // a mismatch by rank instead of hanging or mixing data.
  bool checks_collectives() const;

  // The signal that aborts this group's waits (Design note [aborting a group's waits], abort.h),
  // shared with every subgroup made from it.
  const std::shared_ptr<AbortSignal>& abort_signal() const;
  // From now on this group's waits abort with `parent`'s signal: for a group made with create()
  // beside it (the checkpoints' own background groups) that must not outlive its failure.
  void share_abort_signal(const ProcessGroup& parent);

  // Design note [a group re-pointed]
  // --------------------------------
  // In-process recovery (Design note [in-process recovery], train/elastic.h) makes every
  // generation's groups afresh, but a tensor-parallel model is built on its tensor group and holds
  // it: its layers, its loss, the strategy's record of the cut each hold a copy of the handle. A
  // unit that survives keeps its tensor ranks (Design note [whole units]), so the model stays
  // right if every copy goes on over the new generation's group of the same ranks: repoint()
  // swaps the state all copies share for `fresh`'s (c10d 2.14's Backend::reconfigure does the
  // like under one ProcessGroup object). It returns a handle to the state it replaced, for the
  // caller to keep (an aborted group is never destroyed: Design note [aborting a group's waits]).
  // Only where no operation of this group is in flight on another thread; `fresh` must have this
  // group's size and this rank's place in it (a tensor piece would be another's otherwise).
  ProcessGroup repoint(const ProcessGroup& fresh);

 private:
  struct State;
  explicit ProcessGroup(std::shared_ptr<State> s) : state_(std::move(s)) {}
  // create() with the members' nodes known already (`nodes`, by group rank: split() derives them
  // from its parent), or exchanged through the store when `nodes` is empty.
  static ProcessGroup make(BackendKind kind, c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                           std::chrono::milliseconds timeout, std::vector<int> global_ranks, c10::Device device,
                           int node, std::vector<int> nodes);
  const State& state() const;
  std::shared_ptr<State> state_;
};

}  // namespace dtrain::comm
