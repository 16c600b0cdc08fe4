#pragma once
// The Gloo group of a background worker (the AsyncSaver's writer, the PartnerSnapshots' exchange).
#include <sys/types.h>

#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::checkpoint::detail {

// Design note [background groups yield once ready]
// ------------------------------------------------
// A background save's or snapshot's bytes should yield the cores to the training's own collectives
// and compute, so the threads Gloo starts for its group (the event loop that receives, the workers)
// end in Linux's SCHED_IDLE class (util::lower_this_threads_priority). But a recovery waits for a
// new generation's group and its first snapshot: there, threads in SCHED_IDLE ran only when a core
// had nothing else to do (a replacement starting, the other ranks), 5.6 s to make the group and
// 6.7 s for the snapshot on two busy cores, 12-17 s of a recovery that took 3 at the ordinary
// priority (bench/elastic_link_bench.py, docs/elastic.md). So the group is made, and its threads
// start, at the ordinary priority; `yield_cores` moves them to SCHED_IDLE once the caller no longer
// waits on them (the saver at once, the snapshots after a generation's first one). Lowering a
// thread is always allowed; raising it back is not (without privileges), hence this order.
struct BackgroundGroup {
  comm::ProcessGroup group;
  // The threads Gloo started for it: made by a thread named "dtrain-bg" (as `top -H` shows them), whose
  // name they inherit (libtorch 1.13) or which they replace by Gloo's own (gloo_tcp_loop,
  // pt_gloo_runloop: later versions), either telling them from any other thread the process
  // starts meanwhile.
  std::vector<pid_t> threads;
};

// Collective over `pg`'s members (each calls it at the same point of pg's sequence): a new Gloo group
// over the same ranks, under `prefix` in pg's store, sharing pg's abort signal.
BackgroundGroup background_group(const comm::ProcessGroup& pg, const std::string& prefix);

// The threads into SCHED_IDLE (nice 19 where the class is refused); ones that ended are skipped.
void yield_cores(const std::vector<pid_t>& threads);

}  // namespace dtrain::checkpoint::detail
