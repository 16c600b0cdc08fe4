#pragma once
// Checkpoints that cost the step only a copy (docs/checkpoint.md#asynchronous-saves).
//
// Design note [asynchronous saves]: a save copies every piece this rank writes into host buffers
// that live in the saver and are reused from save to save (pinned where the data is on a GPU, so
// the copy runs at the link's speed), and returns; a background thread then runs checkpoint::save
// on those copies: the same format, hashes and atomic commit as a synchronous save, so one reader
// loads both. The thread talks to the other ranks over a Gloo group of its own, made once over the
// training group's store, so its collectives never interleave with the training's (NCCL's too:
// the checkpoint group is Gloo whatever the training's backend). At most one save is in flight: the
// next save waits for it (the wait is part of its stall). A failed background save is rethrown by
// the next check(), save() or wait() on that rank; the protocol guarantees `latest` still names the
// last complete checkpoint. A C++ writer needs no process of its own (PyTorch's DCP moved its writer
// out of the trainer's threads because of Python's interpreter lock). Where cores are scarce the
// writer yields them: its thread, and the threads Gloo starts for its group, run in Linux's
// SCHED_IDLE class (util::lower_this_threads_priority; the group's threads moved there once it is
// made: Design note [background groups yield once ready], src/checkpoint/background_group.h); the
// partner snapshots' exchange does the same once a generation's first snapshot is taken.
//
// Design note [a copy overlapped with the next step]: most of a training state (the parameters and
// the optimizer's state) changes only in the optimizer's step; the next step's forwards and
// backwards read it. A save given those tensors (`steady`) copies only the rest before it returns
// (buffers such as BatchNorm's running statistics, which a forward changes, random states, rank-
// local pieces) and leaves the steady pieces to the background thread, which copies them first and
// then writes; the loop calls copied() before its next optimizer step (the fence). The stall is then
// the small copies plus whatever of the big copy the forwards and backwards did not hide (PyTorch's
// DCP stages on a side stream and torchtitan waits for the staging just before optimizer.step()).
// A piece counts as steady when its data lie in the storage of a steady tensor: a piece the
// snapshot made (a copy, a cast) is copied at once. The loop's forwards and backwards must then not
// change the parameters in place (none of dtrain's strategies does; a user's forward that does must
// save without `steady`). On CUDA the background copy runs on that thread's current stream, after
// the work queued before the save; the fence makes the optimizer's kernels come after it.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::checkpoint {

// One save as the saving rank saw it.
struct AsyncSaveStats {
  int64_t step = -1;
  double stall_s = 0;   // what save() held the caller: waiting for the previous save, then its copies
  double waited_s = 0;  // the part of stall_s spent waiting for the previous save
  double copy_s = 0;    // the background copy of the steady pieces (known once it finished)
  int64_t overlapped_bytes = 0;  // of `bytes`, those the background thread copied
  double write_s = 0;   // the background part (files, hashes, commit); known once it finished
  double write_cpu_s = 0;  // the CPU time the background thread took for it (copy, hashes, writes)
  int64_t bytes = 0;    // this rank's bytes
};

class AsyncSaver {
 public:
  // Collective over `pg` (every member constructs its saver at the same point): creates the saver's
  // own Gloo group over the same ranks.
  explicit AsyncSaver(const comm::ProcessGroup& pg, SaveOptions options = {});
  // Waits for the save in flight; a failure is printed (naming the rank), not thrown.
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // Collective over the saver's group. Waits for the save in flight (rethrowing its failure), copies
  // `pieces` into the saver's buffers and starts writing checkpoint `step` under `root` (as
  // checkpoint::save) in the background. The pieces' tensors may change as soon as it returns.
  // With `steady` (Design note [a copy overlapped with the next step]): the pieces whose data lie in
  // the storage of one of `steady` are copied by the background thread; the caller must not change
  // those tensors until copied() returned.
  AsyncSaveStats save(const std::string& root, int64_t step, const std::vector<Piece>& pieces,
                      const std::map<std::string, std::string>& metadata, const std::vector<at::Tensor>& steady = {});
  // Waits until the background copy of the last save's steady pieces is done (at once when there is
  // none); returns the seconds waited. Not collective; a failed copy is reported as a failed save.
  double copied();
  // Allocates and touches, in the background, host buffers for pieces shaped like `pieces` (keys,
  // sizes, dtypes, devices; their data are not read), so that the first save copies only, as later
  // ones do (fresh memory is page-faulted in at a fraction of the copy's speed: 0.55-0.8 s for the
  // 146 MiB of a rank of the state-heavy GPT). Not collective; the next save() waits for it.
  void reserve(const std::vector<Piece>& pieces);
  // Rethrows the failure of a background save that has finished (once); never blocks. (This
  // rank's view only: a loop whose ranks must stop at the same step agrees on failed() first.)
  void check();
  // Whether a background save has finished and failed (not yet rethrown); never blocks.
  bool failed() const;
  // A background save that finished since the last call, with its write_s (each once).
  std::optional<AsyncSaveStats> finished();
  // Waits for the save in flight; rethrows its failure.
  void wait();
  bool in_flight() const;
  // Bytes of the host buffers held for the copies.
  int64_t buffer_bytes() const;
  // For a regroup (--elastic, train/elastic.h): waits for the save in flight (ended, or aborted with
  // its generation's groups where a member was lost: its checkpoint is then not committed, and the
  // failure is printed, not thrown), frees the buffers and returns the saver's group for the
  // caller to keep (a Gloo group a lost peer left waiting is never destroyed: Design note
  // [aborting a group's waits]). The saver is spent: only its destruction may follow.
  comm::ProcessGroup abandon();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace dtrain::checkpoint
