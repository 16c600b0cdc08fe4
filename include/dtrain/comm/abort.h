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
// Unarmed (every run but --elastic), waits block in the backend as before. Gloo's send and
// receive works (libtorch 1.13 and 2.x) learn of their completion only in a blocking wait, so
// polling never ends them; they are ended instead through c10d's Work::abort (Gloo's
// UnboundBuffer::abortWaitRecv/abortWaitSend: the blocked wait returns "not completed"): while
// armed, such a wait registers with the signal (on_abort) and the raise aborts it, so a pipeline
// stage waiting for its peer is ended like any collective. The operation stays posted on the
// aborted group's connection (Gloo may still write into or read from its tensor when the peer
// answers), so an interrupted work is kept for the process's life (src/comm/work.cpp), as the
// aborted group is. (Until this, a stage waited out the
// collective timeout in a receive when its peer left the step through a collective outside the
// pipeline's own run: the residual race of docs/elastic.md.)
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace dtrain::comm {

class AbortSignal {
 public:
  // From now on waits poll and can be aborted.
  void arm() { armed_.store(true); }
  bool armed() const { return armed_.load(); }
  // Raises the signal (the first reason is kept); arms it too; runs the registered on_abort calls.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.load()) why_ = why;
    aborted_.store(true);
    armed_.store(true);
    for (auto& [id, fn] : on_abort_) fn();
    on_abort_.clear();
  }
  // `fn` runs once when the signal is raised (at once, here, if it was): what ends a wait that
  // polling cannot (a Gloo send or receive). Keep it short: it runs under the signal's lock. The
  // id is for forget(). (Registering does not change what the signal says: const.)
  uint64_t on_abort(std::function<void()> fn) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.load()) {
      fn();
      return 0;
    }
    on_abort_.emplace(++next_id_, std::move(fn));
    return next_id_;
  }
  // The wait ended: `id`'s call will not run (0: nothing to forget).
  void forget(uint64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    on_abort_.erase(id);
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
  mutable std::map<uint64_t, std::function<void()>> on_abort_;
  mutable uint64_t next_id_ = 0;
};

}  // namespace dtrain::comm
