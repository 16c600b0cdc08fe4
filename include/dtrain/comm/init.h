#pragma once
// init_process_group: the entry point, as torch.distributed.init_process_group.
//
// init_method:
//   env://             RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (+ LOCAL_RANK, LOCAL_WORLD_SIZE),
//                      as set by dtrun and torchrun; with TORCHELASTIC_USE_AGENT_STORE=True the
//                      launcher already hosts the store and every rank connects as a client.
//                      Under srun (SLURM_PROCID set, RANK unset) the SLURM variables are used.
//   tcp://host:port    rank 0 hosts the store; rank and world size from options or env.
//   file:///path       a shared file; rank and world size from options or env.
#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include <torch/arg.h>

#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

struct InitOptions {
  // "gloo", "nccl", "mpi" or "auto" (NCCL when CUDA is available and libtorch has it, else Gloo).
  TORCH_ARG(std::string, backend) = "auto";
  TORCH_ARG(std::string, init_method) = "env://";
  TORCH_ARG(int, rank) = -1;        // -1: from the environment
  TORCH_ARG(int, world_size) = -1;  // -1: from the environment
  TORCH_ARG(std::chrono::milliseconds, timeout) = kDefaultTimeout;
  // Sets libtorch's intra-op threads to max(1, cores / LOCAL_WORLD_SIZE) unless OMP_NUM_THREADS
  // or DTRAIN_NUM_THREADS says otherwise: ranks on one machine share its cores.
  TORCH_ARG(bool, configure_threads) = true;
};

// Where this process sits, as the launcher (dtrun, torchrun, srun) described it.
struct LaunchInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;  // -1: not given
  bool use_agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE
  int restart_count = 0;         // TORCHELASTIC_RESTART_COUNT
  std::string source = "default";  // "env", "slurm" or "default" (single process)
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
// Reads the launcher's variables through `env` (testable without touching the real environment).
// Throws std::invalid_argument naming the variable when one is malformed or inconsistent.
LaunchInfo resolve_launch_info(const EnvLookup& env);
LaunchInfo resolve_launch_info();  // from the process environment

// First host of a SLURM hostlist: "node[03-05,9],gpu1" -> "node03".
std::string slurm_first_host(const std::string& nodelist);

ProcessGroup init_process_group(const InitOptions& options = {});

// The store init_process_group's groups are made over (env:// under dtrun's agent store), without
// making a group: what a process that joins a running job (train/elastic.h) starts from. Throws
// CommError when the process was not started by dtrun.
c10::intrusive_ptr<c10d::Store> job_store(const InitOptions& options = {});

// Intra-op threads per rank on a shared machine: max(1, hardware cores / local_world_size),
// overridden by DTRAIN_NUM_THREADS or OMP_NUM_THREADS.
int default_threads_per_rank(int local_world_size);

}  // namespace dtrain::comm
