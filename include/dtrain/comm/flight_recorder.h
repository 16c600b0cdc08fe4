#pragma once
// The flight recorder: each rank's recent collectives and point-to-point operations, as PyTorch's
// flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) keeps them, so that a hang or a desync can be
// named: which rank is in which operation of which group, since when.
//
// Design note [flight recorder]
// -----------------------------
// Every operation the comm layer launches (comm/detail.h: launch) records an Entry when it starts
// and marks it when its Work completes or fails: the group's name, the operation's sequence
// number in that group (the same on every member for the same call, because every member must
// call a group's collectives in the same order), what it is ("all_reduce(sum, 134912 x Float)"),
// its state and times. The ring keeps the last kCapacity entries.
//  - Under dtrun the ring lives in a file the launcher gave (DTRAIN_FLIGHT_DIR/rank-<RANK>.fr),
//    mapped shared: dtrun reads every local rank's ring at any moment without the rank's help, so
//    a rank that is stopped, spinning or deadlocked is still described (launch/stall.h). A counter
//    in the header moves at every start and end: the rank's communication progress.
//  - Otherwise (torchrun, srun, a plain process) the ring is in memory; dump() prints it, and a
//    timed-out collective's error includes it and names the ranks missing from it (comm/work.h).
// Writers take a mutex (collectives start on autograd threads too); the reader takes no lock and
// may see an entry being written (it is a diagnosis, not data): `state` is written last.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::comm::flight {

inline constexpr uint32_t kCapacity = 256;

enum class OpState : uint32_t {
  Empty = 0,      // slot never written
  Started = 1,    // launched, not yet completed (in flight, or never waited for)
  Completed = 2,  // its Work finished
  Failed = 3,     // its Work threw
};

struct Entry {
  uint64_t seq = 0;         // in its group, 1-based
  double start_s = 0;       // wall-clock seconds (CLOCK_REALTIME)
  double end_s = 0;         // 0 while Started
  uint32_t state = 0;       // OpState
  uint32_t pad = 0;
  char group[32] = {};      // "world", "world/0", ...
  char what[112] = {};      // "all_reduce(sum, 134912 x Float)"
};

struct Header {
  char magic[8] = {};       // "DTRNFR1"
  uint32_t capacity = 0;
  int32_t rank = -1;        // world rank (RANK)
  int32_t pid = 0;
  uint32_t pad = 0;
  uint64_t events = 0;      // +1 at every start and end: communication progress
  uint64_t written = 0;     // entries written so far (slot = index % capacity)
  int64_t step = 0;         // the training loop's last finished step (note_step), 0 if none
};

// Records the start of an operation; returns a handle for end(). Thread-safe.
uint64_t start(const std::string& group, uint64_t seq, const std::string& what);
void end(uint64_t handle, bool ok);
// The training loop says which step finished (shown in reports; not progress by itself).
void note_step(int64_t step);

// What one rank recorded, oldest first.
struct Snapshot {
  int rank = -1;
  int pid = 0;
  uint64_t events = 0;
  int64_t step = 0;
  std::vector<Entry> entries;
};
Snapshot snapshot();  // this process
// A rank's recorder file (DTRAIN_FLIGHT_DIR/rank-<r>.fr); nullopt if absent or not one.
std::optional<Snapshot> read_file(const std::string& path);
// Only its progress counter (Header::events): what a stall check samples every half second.
std::optional<uint64_t> read_events(const std::string& path);
// The file name of rank `rank`'s recorder in `dir`.
std::string file_for(const std::string& dir, int rank);

// The last `n` entries as lines: "all_reduce(sum, 10 x Float) group world #17 completed 0.3 s ago".
std::string describe(const Snapshot& s, size_t n = 8, double now_s = -1);
double now_seconds();

}  // namespace dtrain::comm::flight
