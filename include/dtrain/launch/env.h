#pragma once
// The environment contract between dtrun and its workers (the same variables as torchrun).
//
//   RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (node rank), GROUP_WORLD_SIZE
//   (nodes), ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT,
//   TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
//   TORCHELASTIC_USE_AGENT_STORE=True, DTRUN=1, and DTRAIN_STDOUT_ISATTY (1 when dtrun's stdout
//   is a terminal, else 0). Global ranks are node_rank * nproc_per_node + local_rank.
//
// Programs read them with dtrain::comm::resolve_launch_info() (dtrain/comm/init.h), which also
// understands torchrun and srun.
#include <map>
#include <string>
#include <vector>

#include "dtrain/launch/options.h"

namespace dtrain::launch {

using EnvMap = std::map<std::string, std::string>;

// The variables dtrun sets for worker `local_rank` of this node in restart round `restart`
// (0 for the first attempt). `options.master_port` must be the real port (not 0). Pure.
EnvMap worker_env(const LaunchOptions& options, int local_rank, int restart);

// `base` ("NAME=value" entries, e.g. from environ) with `overrides` replacing or adding entries.
// The result keeps base's order, then the new names in sorted order.
std::vector<std::string> merge_env(const std::vector<std::string>& base, const EnvMap& overrides);

// The current process environment as "NAME=value" entries.
std::vector<std::string> current_env();

// The rank prefix of worker output lines: "[<global rank>]:".
std::string output_prefix(int global_rank);

}  // namespace dtrain::launch
