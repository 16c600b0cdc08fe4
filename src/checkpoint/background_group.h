#pragma once
// The Gloo group of a background worker (the AsyncSaver's writer, the PartnerSnapshots' exchange).
#include "dtrain/comm/process_group.h"

namespace dtrain::checkpoint::detail {

// Collective over `pg`'s members (each calls it at the same point of pg's sequence): a new Gloo group
// over the same ranks, under `prefix` in pg's store, made from a thread in Linux's SCHED_IDLE class
// (util::lower_this_threads_priority), so that the threads Gloo starts for it (its device's event
// loop, its workers) inherit the class: the bytes a background save or snapshot moves through it
// yield the cores to the training's own collectives and compute.
comm::ProcessGroup background_group(const comm::ProcessGroup& pg, const std::string& prefix);

}  // namespace dtrain::checkpoint::detail
