#include "dtrain/launch/env.h"

#include <set>
#include <stdexcept>

extern char** environ;

namespace dtrain::launch {

EnvMap worker_env(const LaunchOptions& o, int local_rank, int restart) {
  if (local_rank < 0 || local_rank >= o.nproc_per_node)
    throw std::invalid_argument("worker_env: local rank " + std::to_string(local_rank) +
                                " out of range 0.." + std::to_string(o.nproc_per_node - 1));
  if (o.master_port <= 0 || o.master_port > 65535)
    throw std::invalid_argument("worker_env: master port " + std::to_string(o.master_port) +
                                " is not resolved to a real port");
  const int rank = o.node_rank * o.nproc_per_node + local_rank;
  const std::string world = std::to_string(o.world_size());
  EnvMap env{
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", world},
      {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(o.nnodes)},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", world},
      {"ROLE_NAME", o.role},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
      {"TORCHELASTIC_RUN_ID", o.run_id},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"DTRUN", "1"},
  };
  // Always set, so a value inherited from an outer launcher cannot leak through.
  env["DTRAIN_STDOUT_ISATTY"] = o.stdout_isatty ? "1" : "0";
  return env;
}

std::vector<std::string> merge_env(const std::vector<std::string>& base, const EnvMap& overrides) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& entry : base) {
    auto eq = entry.find('=');
    std::string name = entry.substr(0, eq);
    if (!seen.insert(name).second) continue;  // a duplicate name: the first one wins, as getenv
    auto it = overrides.find(name);
    out.push_back(it == overrides.end() ? entry : name + "=" + it->second);
  }
  for (const auto& [name, value] : overrides)
    if (!seen.count(name)) out.push_back(name + "=" + value);
  return out;
}

std::vector<std::string> current_env() {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) out.emplace_back(*e);
  return out;
}

std::string output_prefix(int global_rank) { return "[" + std::to_string(global_rank) + "]:"; }

}  // namespace dtrain::launch
