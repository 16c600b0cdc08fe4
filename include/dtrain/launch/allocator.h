#pragma once
// dtrun --allocator auto|system|tcmalloc|jemalloc: the memory allocator the workers run on.
//
// Design note [the workers' allocator]
// ------------------------------------
// glibc's malloc keeps much of what it frees in its heaps (fragmented by blocks of many sizes freed
// and taken again every step), so a sharded strategy's savings do not show in a rank's resident
// memory: FSDP's gathered units and gradient blocks, a few MiB each, leave tens of MiB of free
// blocks that glibc never returns (issue 32: FSDP's peak RSS above DDP's on the state-heavy GPT).
// tcmalloc and jemalloc keep per-size free lists and give memory back, and are faster on libtorch's
// allocation pattern. PyTorch's own CPU launcher (torch.backends.xeon.run_cpu) preloads one by
// default; dtrun does the same for its workers only (LD_PRELOAD before any the user set, dtrun
// itself untouched): `auto` takes the first installed of the order measured on this project's
// runs (docs/launch.md has the figures), `system` leaves glibc's. A worker reads which one it
// runs on from its own mappings (util::allocator_in_use), so the choice is reported under any
// launcher.
#include <functional>
#include <optional>
#include <string>

#include "dtrain/launch/env.h"

namespace dtrain::launch {

enum class Allocator { System, Tcmalloc, Jemalloc };
const char* to_string(Allocator a);

struct AllocatorChoice {
  Allocator kind = Allocator::System;
  std::string library;  // the file preloaded ("" for the system's)
  bool automatic = false;  // chosen by auto
};

// Where `kind`'s library is installed (the usual library directories, the conda prefix's; first
// found), or nullopt. `exists`: how to test a path (tests pass their own).
std::optional<std::string> find_allocator(Allocator kind, const std::function<bool(const std::string&)>& exists);

// --allocator's value resolved: auto -> the first installed of tcmalloc, jemalloc, else the
// system's; a named one that is not installed is a UsageError naming the package to install.
AllocatorChoice choose_allocator(const std::string& request, const std::function<bool(const std::string&)>& exists);

// The workers' variables for `choice`: LD_PRELOAD with the library first, then `user_preload`
// (the value dtrun found, "" when none). Empty for the system's allocator.
EnvMap allocator_env(const AllocatorChoice& choice, const std::string& user_preload);

// "tcmalloc (/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4)" / "the system's (glibc)".
std::string describe(const AllocatorChoice& choice);

}  // namespace dtrain::launch
