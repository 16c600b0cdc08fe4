#include "dtrain/comm/work.h"

#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/flight_recorder.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm {

namespace {
// Gloo's send and receive works whose wait was interrupted: Gloo keeps the operation posted on the
// (never destroyed) aborted group's connection and may still write into, or read from, their
// tensors, which only the work holds; so they are kept for the process's life (Design note
// [aborting a group's waits], abort.h).
void keep_forever(compat::WorkPtr work) {
  static std::mutex mu;
  static auto* kept = new std::vector<compat::WorkPtr>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(work));
}

bool contains(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }

// Gloo's and c10d's messages are precise but cryptic; say what most likely happened first.
std::string explain(const std::string& raw) {
  if (contains(raw, "Connection closed by peer") || contains(raw, "Connection reset") ||
      contains(raw, "Broken pipe") || contains(raw, "Connection refused") || contains(raw, "EOF")) {
    return "a peer closed its connection: another rank probably exited or crashed (see its "
           "output above) (" + raw + ")";
  }
  if (contains(raw, "Timed out") || contains(raw, "timed out") || contains(raw, "Timeout") ||
      contains(raw, "timeout")) {
    return "timed out waiting for the other ranks: a rank is missing, stuck, or called a "
           "different collective (raise InitOptions::timeout if the work is just slow) (" + raw + ")";
  }
  if (contains(raw, "op.preamble.length <= op.nbytes") || contains(raw, "size mismatch") ||
      contains(raw, "Mismatch")) {
    return "the ranks passed tensors of different sizes to the same collective (run with "
           "DTRAIN_DEBUG=1 to see which rank) (" + raw + ")";
  }
  return raw;
}
}  // namespace

[[noreturn]] void rethrow_comm_error(const std::string& context, const std::function<std::string()>& on_timeout) {
  try {
    throw;
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    const std::string raw = e.what();
    std::string more;
    if (on_timeout && (contains(raw, "Timed out") || contains(raw, "timed out") || contains(raw, "Timeout") ||
                       contains(raw, "timeout"))) {
      more = on_timeout();
    }
    throw CommError(context + " failed: " + explain(raw) + more);
  }
}

Work::Work(compat::WorkPtr work, std::function<void()> then, std::string context, uint64_t recorded,
           std::function<std::string()> on_timeout, std::shared_ptr<const AbortSignal> abort, bool interrupt)
    : work_(std::move(work)), then_(std::move(then)), context_(std::move(context)), recorded_(recorded),
      on_timeout_(std::move(on_timeout)), abort_(std::move(abort)), interrupt_(interrupt) {}

void Work::wait_backend() {
  if (abort_ && interrupt_) {  // (Design note [aborting a group's waits]: the raise aborts the blocked wait)
    const uint64_t id = abort_->on_abort([w = work_] { w->abort(); });  // (armed or not: a raise arms)
    bool completed = false;
    try {
      completed = work_->wait();
    } catch (...) {
      abort_->forget(id);
      keep_forever(work_);
      throw;
    }
    abort_->forget(id);
    if (!completed) {
      keep_forever(work_);
      throw CommError(context_ + " aborted: " + abort_->reason().value_or("the wait was aborted"));
    }
    return;
  }
  if (!abort_ || !abort_->armed()) {
    work_->wait();
    return;
  }
  // Design note [aborting a group's waits] (abort.h): poll, so another thread can end the wait.
  auto pause = std::chrono::microseconds(20);
  while (!work_->isCompleted()) {
    if (auto why = abort_->reason()) throw CommError(context_ + " aborted: " + *why);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  work_->wait();  // (done: returns, or throws the backend's failure)
}

void Work::abandon() {
  if (work_ && !done_) keep_forever(work_);
  done_ = true;
  then_ = nullptr;
}

Work Work::after(Work first, std::function<void()> then) {
  Work w;
  w.context_ = first.context_;
  w.before_ = std::make_shared<Work>(std::move(first));
  w.then_ = std::move(then);
  return w;
}

struct Work::Stages {
  Work current;                             // the stage running
  std::vector<std::function<Work()>> next;  // (front first)
  size_t started = 0;                       // stages of `next` started so far
  std::function<void()> then;
  bool done = false;
};

Work Work::staged(Work first, std::vector<std::function<Work()>> next, std::function<void()> then) {
  Work w;
  w.context_ = first.context_;
  w.stages_ = std::make_shared<Stages>();
  w.stages_->current = std::move(first);
  w.stages_->next = std::move(next);
  w.stages_->then = std::move(then);
  return w;
}

void Work::advance() {
  if (!stages_ || stages_->done || stages_->started == stages_->next.size()) return;
  start_next_stage();
}

void Work::start_next_stage() {
  Stages& s = *stages_;  // (shared by every copy: whichever advances or waits, all see it)
  try {
    s.current.wait();  // (throws its own CommError)
    auto start = std::move(s.next[s.started++]);
    s.current = start();
  } catch (...) {
    s.done = true;  // (as a failed wait: later waits return; `then` never runs on what failed)
    s.then = nullptr;
    throw;
  }
}

void Work::wait() {
  if (done_) return;
  if (stages_) {
    Stages& s = *stages_;
    while (!s.done && s.started < s.next.size()) start_next_stage();
    if (!s.done) {
      try {
        s.current.wait();
      } catch (...) {
        s.done = true;
        s.then = nullptr;
        throw;
      }
      s.done = true;
      if (s.then) {
        auto then = std::move(s.then);
        s.then = nullptr;
        then();
      }
    }
    done_ = true;
    return;
  }
  if (before_) {
    try {
      before_->wait();  // (throws its own CommError)
    } catch (...) {
      done_ = true;  // (as a failed wait: later waits return; `then` never runs on what failed)
      then_ = nullptr;
      throw;
    }
  }
  try {
    if (work_) wait_backend();
  } catch (const std::exception&) {
    done_ = true;
    if (recorded_ != kNotRecorded) flight::end(recorded_, false);
    rethrow_comm_error(context_, on_timeout_);
  }
  if (recorded_ != kNotRecorded) flight::end(recorded_, true);
  done_ = true;
  if (then_) {
    auto then = std::move(then_);
    then_ = nullptr;
    then();
  }
}

bool Work::is_completed() const {
  if (done_) return true;
  if (stages_) return stages_->done;
  if (before_) return false;  // (its continuation may start collectives: it runs in wait() only, in the caller's order)
  return !work_ || work_->isCompleted();
}

}  // namespace dtrain::comm
