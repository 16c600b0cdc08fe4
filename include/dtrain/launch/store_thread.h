#pragma once
// One thread that makes a multi-node agent's store calls, so that its supervision never waits on
// them.
//
// Design note [agents never wait on the store]
// --------------------------------------------
// With several nodes, each dtrun polls node 0's agent store (failures of other nodes, heartbeats,
// the rendezvous and the exit barrier) and reports to it. A store call can take long: node 0's
// server may be stalled by a client (Design note [store server process] bounds that, not to
// zero) or the network may be slow. So the agent never calls the store itself: it submits each
// call to this thread and goes on watching its signals and workers; it looks at the result when
// the call has finished (std::future). A stop signal or a worker's exit is acted upon at once,
// whatever the store does; only what needs the other nodes (whether to restart, the rendezvous)
// waits for answers, and a stop signal ends that wait too.
// Calls run one at a time, in the order submitted (a report is seen by the polls after it). A
// call still running when the agent ends is not waited for: the thread is left to the process's
// exit (as the store itself, Agent::~Agent).
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>

namespace dtrain::launch {

class StoreThread {
 public:
  StoreThread();
  ~StoreThread();
  StoreThread(const StoreThread&) = delete;
  StoreThread& operator=(const StoreThread&) = delete;

  // Runs fn() on the thread after every call submitted before; its result (or exception) in the future.
  template <class F>
  auto submit(F fn) -> std::future<std::invoke_result_t<F>> {
    using R = std::invoke_result_t<F>;
    auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
    auto result = task->get_future();
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->jobs.emplace_back([task] { (*task)(); });
    }
    shared_->cv.notify_one();
    return result;
  }

 private:
  struct Shared {  // shared with the thread, which may outlive this object (see above)
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool stop = false;
    bool busy = false;
  };
  std::shared_ptr<Shared> shared_;
  std::thread thread_;
};

// Whether a future's value is there (without waiting).
template <class T>
bool ready(const std::future<T>& f) {
  return f.valid() && f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

}  // namespace dtrain::launch
