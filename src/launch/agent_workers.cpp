// What this node's workers get: their allocator and cores, their environment, their start
// (the agent's, dtrain/launch/agent.h).
#include <cstdlib>
#include <string>
#include <vector>

#include "agent_internal.h"
#include "dtrain/compat.h"
#include "dtrain/launch/agent.h"
#include "dtrain/launch/cores.h"
#include "dtrain/launch/env.h"
#include "dtrain/launch/workers.h"
#include "dtrain/util/fs.h"

namespace dtrain::launch {

void Agent::place_workers() {
  const char* preload = std::getenv("LD_PRELOAD");
  const bool preloaded = preload && *preload;  // (auto leaves a preload the user chose alone: a sanitizer, an allocator)
  allocator_ = choose_allocator(preloaded && options_.allocator == "auto" ? "system" : options_.allocator,
                                [](const std::string& p) { return util::fs::exists(p); });
  std::string placed = "workers run on " + launch::describe(allocator_) + " (--allocator " + options_.allocator +
                       (preloaded && options_.allocator == "auto" ? ", LD_PRELOAD already set" : "") + ")";
  if (options_.bind_cores != "off") {
    const std::vector<int> cores = by_physical_core(allowed_cores(), physical_core_of);
    core_runs_ = split_cores(cores, options_.nproc_per_node, numa_nodes());
    if (core_runs_.empty() && options_.bind_cores == "on") {
      throw UsageError("--bind-cores on: " + std::to_string(options_.nproc_per_node) + " workers cannot have a core each on " +
                       std::to_string(cores.size()) + " core(s) (" + cpu_list(cores) + "); use --bind-cores off");
    }
  }
  if (!core_runs_.empty()) {
    placed += "; each bound to its cores:";
    for (size_t r = 0; r < core_runs_.size(); ++r) placed += (r ? ", " : " ") + cpu_list(core_runs_[r]);
    placed += " (--bind-cores " + options_.bind_cores + ")";
  }
  output_.log(placed);
}

WorkerSpec Agent::spec_for(int local_rank, const EnvMap& extra) const {
  WorkerSpec spec;
  spec.local_rank = local_rank;
  spec.rank = group_rank() * options_.nproc_per_node + local_rank;
  LaunchOptions dense = options_;  // (ranks over the round's members: Design note [elastic membership])
  dense.node_rank = group_rank();
  dense.nnodes = static_cast<int>(members_.size());
  EnvMap env = worker_env(dense, local_rank, round_);
  // As torchrun: NCCL's watchdog turns a hung collective into a crash that dtrun can see. The
  // name this libtorch reads (compat::kNcclAsyncErrorEnv); a value the user set under either
  // name is left alone.
  if (!std::getenv("NCCL_ASYNC_ERROR_HANDLING") && !std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    env[compat::kNcclAsyncErrorEnv] = "1";
  }
  if (!flight_dir_.empty()) env["DTRAIN_FLIGHT_DIR"] = flight_dir_;  // Design note [flight recorder]
  if (!options_.job_secret.empty()) env["DTRAIN_JOB_SECRET"] = options_.job_secret;  // Design note [control plane]
  const char* preload = std::getenv("LD_PRELOAD");
  for (const auto& [k, v] : allocator_env(allocator_, preload ? preload : "")) env[k] = v;  // Design note [the workers' allocator]
  if (!core_runs_.empty()) {  // Design note [ranks bound to cores]
    spec.cores = core_runs_.at(static_cast<size_t>(local_rank));
    const char* omp = std::getenv("OMP_NUM_THREADS");
    if (!omp || !*omp) env["OMP_NUM_THREADS"] = std::to_string(spec.cores.size());
  }
  for (const auto& [k, v] : extra) env[k] = v;
  spec.env = merge_env(base_env_, env);
  return spec;
}

void Agent::start_workers() {
  std::vector<WorkerSpec> specs;
  for (int lr = 0; lr < options_.nproc_per_node; ++lr) {
    if (admitted_ids_.empty()) {
      specs.push_back(spec_for(lr));
      continue;
    }
    // (a node admitted into a running round: its workers join it, Design note [nodes joining in process])
    const int id = admitted_ids_.at(static_cast<size_t>(lr));
    specs.push_back(spec_for(lr, {{"DTRAIN_ELASTIC_JOIN", std::to_string(id)}}));
    specs.back().rank = id;
  }
  workers_.reset();
  workers_ = std::make_unique<WorkerGroup>(output_.out, output_.err, output_.log, ms(options_.term_timeout_s));
  if (store_->server_pid() > 0) workers_->spare(store_->server_pid());
  if (options_.nnodes > 1 && !options_.elastic()) {  // (elastic: the round's members were said)
    int first = specs.front().rank, last = specs.back().rank;
    output_.log("all " + std::to_string(members_.size()) + " nodes joined; starting ranks " + std::to_string(first) +
                (last != first ? "-" + std::to_string(last) : "") + " of " +
                std::to_string(static_cast<int>(members_.size()) * options_.nproc_per_node) +
                (round_ > 0 ? " (restart " + std::to_string(round_) + ")" : ""));
  }
  workers_->start(program_, options_.command, specs);
  if (stall_) stall_->reset();
}

}  // namespace dtrain::launch
