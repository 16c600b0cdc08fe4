#include "background_group.h"

#include <exception>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dtrain/util/system.h"

namespace dtrain::checkpoint::detail {

comm::ProcessGroup background_group(const comm::ProcessGroup& pg, const std::string& prefix) {
  // A prefix the members agree on without talking: the group's next operation number.
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/" + pg.name() + "/" + std::to_string(pg.next_sequence()),
                                                      pg.store());
  comm::ProcessGroup made;
  std::exception_ptr failure;
  std::thread maker([&] {
    try {
      util::lower_this_threads_priority();  // (inherited by the threads Gloo starts: pthread's default)
      made = comm::ProcessGroup::create(comm::BackendKind::Gloo, store, pg.rank(), pg.size(), pg.timeout(),
                                        pg.global_ranks());
    } catch (...) {
      failure = std::current_exception();
    }
  });
  maker.join();
  if (failure) std::rethrow_exception(failure);
  made.share_abort_signal(pg);  // (a failure that aborts the training's waits aborts these too)
  return made;
}

}  // namespace dtrain::checkpoint::detail
