#pragma once
// Snapshots of every rank's checkpoint state held in a partner rank's memory (issue 29, item 3).
//
// Design note [partner snapshots]: every --snapshot-every steps each rank hands the pieces a
// checkpoint of that step would hold for it (checkpoint::Piece: model and optimizer shards, random
// states) to its partner, rank (r + stride) mod W, and keeps a copy of its own; stride is the ranks
// per node where the job spans nodes, so the copy lives on another machine. The state of any one
// lost rank then exists twice in memory, and rebuild_checkpoint writes the full checkpoint of the
// snapshot's step from the survivors alone: each survivor saves its own pieces and those it holds
// for a lost rank, through checkpoint::save (the same format, loadable at any world size). The
// bytes travel through c10d (a Gloo group of the snapshots' own, whatever the training's backend),
// never a socket of dtrain's; the copies live in host memory (Gemini, SOSP '23, keeps checkpoints
// in peers' CPU memory the same way). The host buffers are kept from snapshot to snapshot, two of
// each (double buffers: a snapshot fills the pair the complete one does not use, and becomes the
// current pair only once its exchange completed, so a partner lost during an exchange leaves the
// previous step's pair whole): 4x the rank's snapshot bytes of host memory, no allocation and no
// page faults after the second snapshot. Pieces are views of the live state (Design note
// [snapshots are views], piece.h): packing them is the one copy.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <thread>
#include <vector>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::checkpoint {

// One rank's snapshot as held in memory (host copies of its pieces).
struct HeldSnapshot {
  int rank = -1;  // whose state (rank in the snapshots' group)
  int64_t step = -1;
  std::vector<Piece> pieces;
  std::map<std::string, std::string> metadata;
  int64_t bytes() const;
};

class PartnerSnapshots {
 public:
  // Collective over `pg` (every member at the same point): makes the snapshots' Gloo group.
  // `stride`: the distance to the partner (ranks per node when several nodes; 1 on one node).
  explicit PartnerSnapshots(const comm::ProcessGroup& pg, int stride = 1);

  ~PartnerSnapshots();  // waits for an exchange in flight
  PartnerSnapshots(const PartnerSnapshots&) = delete;
  PartnerSnapshots& operator=(const PartnerSnapshots&) = delete;

  // Collective: keeps a host copy of `pieces` as this rank's snapshot of `step`, sends one to
  // partner() and receives holding_for()'s. Returns the seconds it held the caller. First waits for
  // the previous snapshot's exchange (rethrowing its failure). With `steady` (Design note [a copy
  // overlapped with the next step], async_saver.h): the pieces in their storage are packed and the
  // pair exchanged by a background thread; the caller calls packed() before changing `steady`.
  double take(int64_t step, const std::vector<Piece>& pieces, const std::map<std::string, std::string>& metadata,
              const std::vector<at::Tensor>& steady = {});
  // Waits until the background packing of the last take's steady pieces is done; seconds waited.
  double packed();
  // Waits for the exchange in flight; rethrows its failure (the previous pair stays the newest).
  void wait();
  bool in_flight() const;
  // The group's Gloo threads and the exchanges' background thread yield the cores from now on
  // (SCHED_IDLE). They start at the ordinary priority so that a recovery waiting on a new
  // generation's first snapshot is not starved: call this once nothing waits on them (Design note
  // [background groups yield once ready], src/checkpoint/background_group.h). Once.
  void yield_cores();

  int partner() const;      // the rank that holds this rank's snapshot
  int holding_for() const;  // the rank whose snapshot this rank holds
  int keeper_of(int rank) const;  // the rank that holds `rank`'s snapshot
  // The newest complete pair (views into this object's buffers: valid until the second take()
  // after; copy what must live longer). Not while an exchange is in flight (wait() first).
  const HeldSnapshot& mine() const;
  const HeldSnapshot& held() const;
  // The steps of the complete pairs, newest first: the newest, and the one before it until the
  // next take() reuses its buffers (a rank whose last exchange failed keeps the one before; the
  // others can still roll back to it). Not while an exchange is in flight.
  std::vector<int64_t> steps() const;
  // This rank's own snapshot and the one it holds of `step` (one of steps(); else nullptr).
  const HeldSnapshot* mine_of(int64_t step) const;
  const HeldSnapshot* held_of(int64_t step) const;
  int size() const { return group_.size(); }  // the ranks of the snapshots' group
  const comm::ProcessGroup& group() const { return group_; }
  int rank() const { return group_.rank(); }

 private:
  comm::ProcessGroup group_;
  std::vector<pid_t> gloo_threads_;  // (until yield_cores)
  std::atomic<bool> yielding_{false};  // (yield_cores was called)
  int stride_ = 1;
  HeldSnapshot mine_, held_;  // views into packed_[current_] and received_[current_]
  HeldSnapshot previous_mine_, previous_held_;  // the pair before, in the other slot (step -1: reused)
  at::Tensor packed_[2], received_[2];
  int current_ = 1;  // (the first take fills slot 0)
  // The background exchange: packs the steady pieces, then exchange_pair (which sets the three
  // members above once its exchange completed).
  void exchange_pair(int64_t step, int slot, const std::string& header);
  std::thread worker_;
  std::atomic<bool> done_{true};
  std::mutex mu_;  // guards packing_, error_, failed_step_
  std::condition_variable packed_cv_;
  bool packing_ = false;
  std::exception_ptr error_;
  int64_t failed_step_ = -1;
};

// Collective over `survivors` (a group of the ranks still alive, any order): writes the checkpoint
// of the snapshots' step under `root` from this rank's own snapshot and, where `lost` (ranks of the
// snapshots' group) holds the rank whose snapshot this rank holds, that one too. Every lost rank's
// partner must be alive (else: an error naming the rank whose state is gone). Returns the directory.
std::string rebuild_checkpoint(const std::string& root, const comm::ProcessGroup& survivors,
                               const PartnerSnapshots& snapshots, const std::vector<int>& lost,
                               const SaveOptions& options = {});

}  // namespace dtrain::checkpoint
