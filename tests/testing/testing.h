#pragma once
// Helpers shared by the test binaries.
#include <functional>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/traffic.h"

namespace dtrain::testing {

// What fn() threw (its what()), "" when it returned.
std::string error_of(const std::function<void()>& fn);

// Runs fn(pg) on `world` threads, each with its own Gloo process group over one HashStore.
// Rethrows (on the calling thread) the first failure, prefixed with its rank. A deadlock is
// caught by CTest's per-test timeout; the Gloo timeout is `timeout_ms` so most hangs end sooner.
// `nodes` (optional): the node each rank's group says it runs on (ProcessGroup::member_nodes).
void run_ranks(int world, const std::function<void(comm::ProcessGroup&)>& fn, int timeout_ms = 20000,
               const std::vector<int>& nodes = {});

// The process's traffic counters (comm/traffic.h) read while every rank of `pg` waits between two
// barriers: no collective in flight, none started (the counters are the process's, all ranks'
// threads together). Every rank calls it.
comm::Traffic traffic_at_rest(const comm::ProcessGroup& pg);

struct CommandResult {
  int exit_code = -1;   // the shell's exit status (124 when `timeout` killed it)
  std::string output;   // stdout and stderr together
};
// Runs `command` under /bin/sh with a hard time limit (coreutils `timeout -k 5`).
CommandResult run_command(const std::string& command, int timeout_s = 60);

// Design note [shared runs]
// Most of the suite's time is processes starting (libtorch loads in ~0.75 s) to train tiny models,
// and several tests need the same deterministic run (the one-process reference of a parity check,
// the same --plan table). shared_run keeps a run's result under build/test-run-cache, keyed by the
// command (without the caller's temporary paths) and the identity (size, mtime) of the programs,
// dtrun and libdtrain it runs: the first test to need it runs it, the others read it. Only runs
// with no side effects are shared (no --save/--resume/--export-weights/--tensorboard, no test-hook
// environment); a rebuilt binary makes new keys. DTRAIN_TEST_NO_SHARED_RUNS=1 turns it off.
struct SharedRun {
  int exit_code = -1;
  std::string output;   // stdout and stderr together
  std::string metrics;  // the run's --metrics file
};
SharedRun shared_run(const std::string& key, const std::vector<std::string>& programs,
                     const std::function<SharedRun()>& run);

// Design note [test launches]
// A process that loads libtorch spends ~0.85 s of CPU before main (relocations against Debian's
// 289 libraries, libtorch's operator registrations), so `dtrun --nproc-per-node 2` costs three of
// them where the ranks need two. The shared runs (the same deterministic training, no side
// effects) are launched by launch_ranks instead: torch's env:// contract without a launcher
// (RANK, WORLD_SIZE, MASTER_ADDR/PORT of a free port; rank 0 serves the store, no agent store), each
// line prefixed "[rank]:" as dtrun prefixes it, a failed rank stopping the others, on the
// allocator dtrun's default would preload (Design note [the workers' allocator], launch/allocator.h:
// the memory planner's RSS predictions are checked on what users run). What dtrun
// does itself (restarts, stall reports, failure summaries, several nodes) stays tested through
// dtrun: every run with a test hook or dtrun flags goes through it. Runs with side effects
// (--save, --resume, --export-weights) that need neither start through launch_ranks too (not
// shared); dtrun's own save/resume path stays tested by the restart tests and the install test.
// A port free on 127.0.0.1 now (the kernel's pick; a store binds it moments later).
int free_port();
CommandResult launch_ranks(const std::string& command, int world, int timeout_s = 120);

// Absolute path of a built tool, e.g. bin("dtrun").
std::string bin(const std::string& name);
// A fresh empty temporary directory (removed at process exit).
std::string temp_dir();
// The whole of a file ("" when it cannot be read).
std::string read_file(const std::string& path);

}  // namespace dtrain::testing
