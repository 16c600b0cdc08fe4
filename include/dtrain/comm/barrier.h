#pragma once
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

// Returns when every rank of the group has reached it (or throws CommError after the timeout).
Work barrier(const ProcessGroup& pg, bool async_op = false);

}  // namespace dtrain::comm
