#include "background_group.h"

#include <dirent.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

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
}  // namespace

BackgroundGroup background_group(const comm::ProcessGroup& pg, const std::string& prefix) {
  // A prefix the members agree on without talking: the group's next operation number.
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/" + pg.name() + "/" + std::to_string(pg.next_sequence()),
                                                      pg.store());
  BackgroundGroup made;
  const std::vector<pid_t> before = tasks();
  made.group =
      comm::ProcessGroup::create(comm::BackendKind::Gloo, store, pg.rank(), pg.size(), pg.timeout(), pg.global_ranks());
  const std::vector<pid_t> after = tasks();
  std::set_difference(after.begin(), after.end(), before.begin(), before.end(), std::back_inserter(made.threads));
  made.group.share_abort_signal(pg);  // (a failure that aborts the training's waits aborts these too)
  return made;
}

void yield_cores(const std::vector<pid_t>& threads) {
  for (pid_t tid : threads) {
    sched_param none{};
    if (::sched_setscheduler(tid, SCHED_IDLE, &none) == 0) continue;
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19);
  }
}

}  // namespace dtrain::checkpoint::detail
