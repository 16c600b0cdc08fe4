#pragma once
// A handle on an asynchronous collective. wait() blocks until it is done, runs any local
// completion step (e.g. the divide of an Avg, the local sum of a Gloo reduce-scatter) and turns a
// backend failure into a CommError naming rank, operation and cause.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/abort.h"
#include "dtrain/compat.h"

namespace dtrain::comm {

class Work {
 public:
  // A completed no-op.
  Work() = default;
  // `recorded`: its flight-recorder handle (ended at completion); `on_timeout`: text a timeout's
  // error adds (comm/detail.h: diagnose_timeout).
  // `abort`: the group's signal (Design note [aborting a group's waits], abort.h; null: none);
  // `interrupt`: while it is armed, the wait blocks in the backend and the raise ends it through
  // the backend work's abort() (Gloo's send and receive) instead of polling its completion.
  Work(compat::WorkPtr work, std::function<void()> then, std::string context,
       uint64_t recorded = kNotRecorded, std::function<std::string()> on_timeout = nullptr,
       std::shared_ptr<const AbortSignal> abort = nullptr, bool interrupt = false);
  static constexpr uint64_t kNotRecorded = ~uint64_t{0};

  // A work that is done once `first` is and `then` has run after it: a reduction in two phases
  // (the second collective started and waited inside `then`, e.g. ddp::compressed_all_reduce).
  // Its is_completed() is false until it was waited for, so that pollers never run `then` out of
  // the callers' common order. Wait on one copy of it only (copies share `first`, not `then`).
  static Work after(Work first, std::function<void()> then);

  // A work in stages: `first` runs; each of `next`, in order, starts the following stage (an
  // asynchronous work) once the one before is done; `then` runs after the last. advance() waits
  // for the current stage and starts the next (at points the caller chooses: the same on every
  // rank, so that every group sees its collectives in one order); wait() runs what is left. A
  // two-level all-reduce's across level thus starts while backward still runs (Design note
  // [two-level all-reduce], comm/two_level.h). Copies share the stages: any copy may advance or
  // wait, and each stage and `then` run once.
  static Work staged(Work first, std::vector<std::function<Work()>> next, std::function<void()> then = nullptr);
  // One stage further (nothing where no stage is left, or the work is not staged). Throws
  // CommError as wait() does; the work is then done (later waits return).
  void advance();

  // Idempotent; throws CommError on failure.
  void wait();
  // This work will not be waited for: its backend operation, and the tensors it holds, are kept for
  // the process's life (a transfer of an aborted group Gloo may still write into or read from:
  // Design note [aborting a group's waits], abort.h). An interrupted wait does the same itself.
  void abandon();
  bool is_completed() const;

 private:
  compat::WorkPtr work_;
  std::function<void()> then_;
  std::string context_;  // "[dtrain rank 0/2] all_reduce(sum, 10 x Float)"
  uint64_t recorded_ = kNotRecorded;
  std::function<std::string()> on_timeout_;
  bool done_ = false;
  std::shared_ptr<Work> before_;  // (after(): the first phase)
  struct Stages;  // (src/comm/work.cpp)
  std::shared_ptr<Stages> stages_;  // (staged(): every copy shares the stages and their state)
  std::shared_ptr<const AbortSignal> abort_;
  bool interrupt_ = false;
  void wait_backend();  // blocks, or polls (or is interrupted) while the abort signal is armed
  void start_next_stage();  // (staged: waits for the current stage, starts the next)
};

// Runs `fn` (which starts a backend collective) and rethrows its failure as a CommError with
// `context`; used by every collective so error messages read the same everywhere.
[[noreturn]] void rethrow_comm_error(const std::string& context, const std::function<std::string()>& on_timeout = nullptr);

}  // namespace dtrain::comm
