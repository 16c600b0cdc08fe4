#include "background_group.h"

#include <dirent.h>
#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dtrain/util/system.h"

namespace dtrain::checkpoint::detail {
namespace {
// This process's threads (/proc/self/task), sorted.
std::vector<pid_t> tasks() {
  std::vector<pid_t> out;
  if (DIR* dir = ::opendir("/proc/self/task")) {
    while (const dirent* e = ::readdir(dir)) {
      if (e->d_name[0] != '.') out.push_back(static_cast<pid_t>(std::atoi(e->d_name)));
    }
    ::closedir(dir);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A thread's name (/proc/self/task/TID/comm; "" when it is gone).
std::string name_of(pid_t tid) {
  std::string name;
  if (FILE* f = std::fopen(("/proc/self/task/" + std::to_string(tid) + "/comm").c_str(), "r")) {
    char buf[32] = {};
    if (std::fgets(buf, sizeof buf, f)) name = buf;
    std::fclose(f);
  }
  if (!name.empty() && name.back() == '\n') name.pop_back();
  return name;
}

constexpr const char* kMaker = "dtrain-bg";  // (the maker's name, which the threads it starts inherit)
}  // namespace

BackgroundGroup background_group(const comm::ProcessGroup& pg, const std::string& prefix) {
  // A prefix the members agree on without talking: the group's next operation number.
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/" + pg.name() + "/" + std::to_string(pg.next_sequence()),
                                                      pg.store());
  // Made by a thread of its own, named, at the ordinary priority: the threads Gloo starts for the
  // group inherit the name, which tells them from any other thread the process starts meanwhile.
  BackgroundGroup made;
  std::exception_ptr failure;
  const std::vector<pid_t> before = tasks();
  std::thread maker([&] {
    ::pthread_setname_np(::pthread_self(), kMaker);
    try {
      made.group =
          comm::ProcessGroup::create(comm::BackendKind::Gloo, store, pg.rank(), pg.size(), pg.timeout(), pg.global_ranks());
    } catch (...) {
      failure = std::current_exception();
    }
  });
  maker.join();
  if (failure) std::rethrow_exception(failure);
  const std::vector<pid_t> after = tasks();
  std::vector<pid_t> started;
  std::set_difference(after.begin(), after.end(), before.begin(), before.end(), std::back_inserter(started));
  for (pid_t tid : started) {
    // (libtorch 1.13's Gloo threads keep the maker's name; later ones name theirs: gloo_tcp_loop,
    // pt_gloo_runloop)
    const std::string name = name_of(tid);
    if (name == kMaker || name.rfind("gloo", 0) == 0 || name.rfind("pt_gloo", 0) == 0) made.threads.push_back(tid);
  }
  made.group.share_abort_signal(pg);  // (a failure that aborts the training's waits aborts these too)
  return made;
}

void yield_cores(const std::vector<pid_t>& threads) {
  for (pid_t tid : threads) util::lower_thread_priority(tid);
}

}  // namespace dtrain::checkpoint::detail
