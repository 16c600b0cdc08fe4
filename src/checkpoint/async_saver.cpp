// AsyncSaver: Design note [asynchronous saves] in dtrain/checkpoint/async_saver.h.
#include "dtrain/checkpoint/async_saver.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <iostream>
#include <mutex>
#include <thread>

#include <time.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/types.h"
#include "dtrain/util/system.h"
#include "background_group.h"

namespace dtrain::checkpoint {

namespace {

using Clock = std::chrono::steady_clock;


double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& c) {
    return c.what_without_backtrace();
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

struct AsyncSaver::State {
  comm::ProcessGroup group;
  SaveOptions options;
  int rank = 0;
  std::map<std::string, at::Tensor> buffers;  // "key@begin" -> this rank's host copy, reused
  SavePlanCache plan;                         // (Design note [a cached save plan], store.cpp)
  std::thread worker;
  std::atomic<bool> done{true};
  std::mutex mu;  // guards error, current, unreported, and buffers while reserve()'s thread fills them
  std::exception_ptr error;
  AsyncSaveStats current;
  std::optional<AsyncSaveStats> unreported;
  bool reserving = false;  // the worker reserves buffers (reserve()), not a save (the caller's thread only)
  bool copying = false;    // the worker copies the last save's steady pieces (guarded by mu)
  std::condition_variable copy_ended;

  // Joins a finished or running worker; returns its failure (cleared).
  std::exception_ptr join() {
    if (worker.joinable()) worker.join();
    std::lock_guard<std::mutex> lock(mu);
    return std::exchange(error, nullptr);
  }

  void rethrow(const std::exception_ptr& e) const {
    if (!e) return;
    TORCH_CHECK(!reserving, "rank ", rank, ": reserving the asynchronous checkpoints' host buffers failed: ",
                message_of(e));
    const std::string what = "rank " + std::to_string(rank) + ": the asynchronous checkpoint of step " +
                             std::to_string(current.step) +
                             " failed in the background (the checkpoint named by `latest` is the last complete one): " +
                             message_of(e);
    try {  // (a lost peer stays a communication failure: --elastic recovers from it)
      std::rethrow_exception(e);
    } catch (const comm::CommError&) {
      throw comm::CommError(what);
    } catch (...) {
    }
    TORCH_CHECK(false, what);
  }

  static std::string name_of(const Piece& p) { return p.key + "@" + std::to_string(p.begin); }
  static bool fits(const at::Tensor& buf, const Piece& p) {
    return buf.defined() && buf.numel() == p.data.numel() && buf.scalar_type() == p.data.scalar_type();
  }
  static at::Tensor host_buffer(const Piece& p) {
    auto options = at::TensorOptions().dtype(p.data.scalar_type()).device(at::kCPU);
    if (p.data.is_cuda()) options = options.pinned_memory(true);
    return at::empty({p.data.numel()}, options);
  }

  // This rank's copy of `p`'s data in a buffer kept for the next save (pinned for GPU data). From
  // the worker too: the buffer is looked up and made under mu (buffer_bytes() reads the map).
  Piece stage(const Piece& p) {
    at::Tensor buf;
    {
      std::lock_guard<std::mutex> lock(mu);
      at::Tensor& kept = buffers[name_of(p)];
      if (!fits(kept, p)) kept = host_buffer(p);
      buf = kept;
    }
    buf.copy_(p.data.reshape({-1}));
    return Piece{p.key, p.shape, p.begin, buf};
  }

  // The worker thread running `body`; if the thread cannot be made, the saver is left idle (nothing
  // in flight, no copy pending) and the error goes to the caller.
  template <class Body>
  std::thread start_worker(Body&& body) {
    try {
      return std::thread(std::forward<Body>(body));
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu);
        copying = false;
      }
      done = true;
      throw;
    }
  }

  // The worker's copies of the steady pieces (`staged[i]` for i in `deferred`); then copied() returns.
  void copy_deferred(std::vector<Piece>& staged, const std::vector<size_t>& deferred) {
    const auto c0 = Clock::now();
    std::exception_ptr failure;
    try {
      for (size_t i : deferred) staged[i] = stage(staged[i]);
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu);
    current.copy_s = seconds_since(c0);
    copying = false;
    copy_ended.notify_all();
    if (failure) std::rethrow_exception(failure);
  }
};

namespace {
// The calling thread's CPU time so far (user and system), in seconds.
double thread_cpu_s() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

AsyncSaver::AsyncSaver(const comm::ProcessGroup& pg, SaveOptions options) : s_(std::make_unique<State>()) {
  TORCH_CHECK(pg.is_member(), "AsyncSaver: this rank is not a member of the process group");
  // (every member constructs its saver at the same point of pg's sequence; its threads yield at once:
  // Design note [background groups yield once ready])
  detail::BackgroundGroup made = detail::background_group(pg, "async-checkpoint");
  s_->group = made.group;
  detail::yield_cores(made.threads);
  s_->options = options;
  const auto& world_ranks = pg.global_ranks();
  s_->rank = world_ranks.empty() ? pg.rank() : world_ranks.at(static_cast<size_t>(pg.rank()));
}

AsyncSaver::~AsyncSaver() {
  if (!s_) return;
  if (!s_->done.load() && std::uncaught_exceptions() > 0) {
    std::cerr << "dtrain checkpoint: rank " << s_->rank << ": waiting for the background save of step " << s_->current.step
              << " to end before stopping\n";
  }
  if (const auto e = s_->join()) {
    std::cerr << "dtrain checkpoint: rank " << s_->rank << ": the asynchronous checkpoint of step " << s_->current.step
              << " failed: " << message_of(e) << "\n";
  }
}

comm::ProcessGroup AsyncSaver::abandon() {
  TORCH_CHECK(s_, "AsyncSaver::abandon: the saver was abandoned already");
  if (const auto e = s_->join()) {
    std::cerr << "dtrain checkpoint: rank " << s_->rank << ": the asynchronous checkpoint of step " << s_->current.step
              << " was cut by the regroup (not committed): " << message_of(e) << "\n";
  }
  comm::ProcessGroup group = s_->group;
  s_.reset();
  return group;
}

AsyncSaveStats AsyncSaver::save(const std::string& root, int64_t step, const std::vector<Piece>& pieces,
                                const std::map<std::string, std::string>& metadata, const std::vector<at::Tensor>& steady) {
  const auto t0 = Clock::now();
  const bool waited = !s_->done.load();
  s_->rethrow(s_->join());
  AsyncSaveStats stats;
  stats.step = step;
  stats.waited_s = waited ? seconds_since(t0) : 0.0;
  const std::vector<bool> later = in_storage_of(pieces, steady);
  std::vector<Piece> staged;    // (the steady pieces as given, until the worker copies them)
  std::vector<size_t> deferred;  // their indices
  staged.reserve(pieces.size());
  for (const Piece& p : pieces) {
    TORCH_CHECK(p.data.defined(), "AsyncSaver: the piece of \"", p.key, "\" at ", p.begin, " has no data");
    stats.bytes += static_cast<int64_t>(p.data.nbytes());
    if (later[staged.size()]) {
      deferred.push_back(staged.size());
      staged.push_back(p);
      stats.overlapped_bytes += static_cast<int64_t>(p.data.nbytes());
    } else {
      staged.push_back(s_->stage(p));
    }
  }
  stats.stall_s = seconds_since(t0);
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->current = stats;
    s_->copying = !deferred.empty();
  }
  s_->done = false;
  s_->reserving = false;
  State* s = s_.get();
  s_->worker = s_->start_worker([s, root, step, staged = std::move(staged), deferred = std::move(deferred), metadata]() mutable {
    at::NoGradGuard no_grad;  // (the copies of parameters record no autograd history)
    auto w0 = Clock::now();
    const double cpu0 = thread_cpu_s();
    std::exception_ptr failure;
    try {
      if (!deferred.empty()) s->copy_deferred(staged, deferred);  // (at the training's priority: the fence waits for it)
      util::lower_this_threads_priority();  // (util/system.h)
      w0 = Clock::now();
      checkpoint::save(root, step, s->group, staged, metadata, s->options, s->plan);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->error = failure;
      s->current.write_s = seconds_since(w0);
      s->current.write_cpu_s = thread_cpu_s() - cpu0;
      if (!failure) s->unreported = s->current;
    }
    s->done = true;
  });
  return stats;
}

void AsyncSaver::reserve(const std::vector<Piece>& pieces) {
  s_->rethrow(s_->join());
  std::vector<Piece> shapes;  // (data kept only for its size, dtype and device)
  for (const Piece& p : pieces) {
    const auto it = s_->buffers.find(State::name_of(p));
    if (p.data.defined() && (it == s_->buffers.end() || !State::fits(it->second, p))) shapes.push_back(p);
  }
  if (shapes.empty()) return;
  s_->done = false;
  s_->reserving = true;
  State* s = s_.get();
  s_->worker = s_->start_worker([s, shapes = std::move(shapes)] {
    at::NoGradGuard no_grad;
    util::lower_this_threads_priority();  // (util/system.h)
    std::exception_ptr failure;
    std::map<std::string, at::Tensor> made;
    try {
      for (const Piece& p : shapes) made[State::name_of(p)] = State::host_buffer(p).zero_();
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->error = failure;
      for (auto& [name, buf] : made) s->buffers[name] = std::move(buf);
    }
    s->done = true;
  });
}

void AsyncSaver::check() {
  if (!s_->done.load() || !s_->worker.joinable()) return;
  s_->rethrow(s_->join());
}

std::optional<AsyncSaveStats> AsyncSaver::finished() {
  std::lock_guard<std::mutex> lock(s_->mu);
  return std::exchange(s_->unreported, std::nullopt);
}

void AsyncSaver::wait() { s_->rethrow(s_->join()); }

double AsyncSaver::copied() {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(s_->mu);
  if (!s_->copying) return 0.0;
  s_->copy_ended.wait(lock, [this] { return !s_->copying; });
  return seconds_since(t0);
}

bool AsyncSaver::in_flight() const { return !s_->done.load(); }

bool AsyncSaver::failed() const {
  if (!s_->done.load()) return false;
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->error != nullptr;
}

int64_t AsyncSaver::buffer_bytes() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  int64_t total = 0;
  for (const auto& [name, t] : s_->buffers) total += static_cast<int64_t>(t.nbytes());
  return total;
}

}  // namespace dtrain::checkpoint
