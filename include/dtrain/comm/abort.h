#pragma once
// AbortSignal: lets another thread end a rank's waits on a process group's collectives.
//
// Design note [aborting a group's waits]
// --------------------------------------
// libtorch 1.13 cannot abort a Gloo group (2.x has ProcessGroupNCCL::abort, and 2.14 an unstable
// Backend::reconfigure), and a rank waiting for a peer that will never send (a dead rank two hops
// away in Gloo's ring) waits out the whole collective timeout. In-process recovery (Design note
// [in-process recovery], train/elastic.h) cannot: it must drop the step at once. So every group
// carries an AbortSignal, shared with the subgroups made from it. While the signal is armed, a
// Work's wait() polls the backend's completion (short sleeps, at most 1 ms, so a step's few waits
// cost little) and throws a CommError "... aborted: <reason>" as soon as the signal is raised;
// collectives started after it throw at once. The backend's operation itself is left running on
// Gloo's threads until its own timeout: the aborted group is never used again and never destroyed
// (~ProcessGroupGloo would wait for that operation): the last handle of an aborted group, or of a
// subgroup sharing its signal, leaks the backend, so no process waits for it, not even at exit.
// Unarmed (every run but --elastic), waits block in the backend as before. Gloo's send and receive works (libtorch 1.13)
// learn of their completion only in a blocking wait, so polling never ends them: what must be
// abortable exchanges through a collective instead (all_to_all with the partners' splits, as the
// partner snapshots do).
#include <atomic>
#include <mutex>
#include <optional>
#include <string>

namespace dtrain::comm {

class AbortSignal {
 public:
  // From now on waits poll and can be aborted.
  void arm() { armed_.store(true); }
  bool armed() const { return armed_.load(); }
  // Raises the signal (the first reason is kept); arms it too.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load()) why_ = why;
    aborted_.store(true);
    armed_.store(true);
  }
  bool aborted() const { return aborted_.load(); }
  std::optional<std::string> reason() const {
    if (!aborted_.load()) return std::nullopt;
    std::lock_guard<std::mutex> lock(mu_);
    return why_;
  }

 private:
  std::atomic<bool> armed_{false}, aborted_{false};
  mutable std::mutex mu_;
  std::string why_;
};

}  // namespace dtrain::comm
