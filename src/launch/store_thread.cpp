#include "dtrain/launch/store_thread.h"

#include "dtrain/launch/signals.h"

namespace dtrain::launch {

StoreThread::StoreThread() : shared_(std::make_shared<Shared>()) {
  // Signals stay on the main thread (StopSignals): the thread starts with them blocked.
  with_signals_blocked([&] {
    thread_ = std::thread([s = shared_] {
      std::unique_lock<std::mutex> lock(s->mu);
      for (;;) {
        s->cv.wait(lock, [&] { return s->stop || !s->jobs.empty(); });
        if (s->jobs.empty()) return;  // stopping, nothing left
        auto job = std::move(s->jobs.front());
        s->jobs.pop_front();
        s->busy = true;
        lock.unlock();
        job();
        lock.lock();
        s->busy = false;
        if (s->stop) return;  // calls not started are dropped (their futures report broken promises)
      }
    });
  });
}

StoreThread::~StoreThread() {
  bool busy;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->stop = true;
    busy = shared_->busy;
    shared_->jobs.clear();
  }
  shared_->cv.notify_one();
  if (busy) {
    thread_.detach();  // inside a store call that may never return (Design note [agents never wait on the store])
  } else {
    thread_.join();
  }
}

}  // namespace dtrain::launch
