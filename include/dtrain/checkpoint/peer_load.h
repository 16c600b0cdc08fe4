#pragma once
// checkpoint::load_from_peers: state the ranks hold in memory (their live state, or a lost rank's
// partner snapshot) loaded at another world size, without the disk.
//
// Design note [state re-split from memory]
// ----------------------------------------
// In-process recovery of sharded state (Design note [in-process recovery], train/elastic.h)
// re-splits what the ranks hold over a new world. The loaders exist already: every strategy loads
// a checkpoint at any world size by asking a Reader for the ranges it needs (piece.h). So the
// memory is made to look like a checkpoint: each rank offers the pieces it holds, their index is
// all-gathered, and `load` runs twice against Readers over that index. The first run records the
// ranges this rank asks for (and reads zeros); the requests are all-gathered; every holder sends
// each requester the bytes it holds of them in one c10d all_to_all (uneven splits: both sides
// derive the same layout from the two indexes); the second run reads the same ranges from what
// arrived. Each element comes from one holder (the lowest rank where several hold it), and a rank
// receives only what it loads. Hence two rules for `load`: it asks for the same ranges whatever
// values it reads (the strategies' loaders do: their ranges follow from shapes and the world),
// and it must not write into the tensors the held pieces view before the exchange (the first run
// writes zeros): offer copies where the pieces are the live state being reloaded.
// A rank whose first run fails sends its error instead of its requests, and the second run's
// outcome is all-gathered too: every rank then throws the error, naming the rank (no rank goes on
// while another stopped). Host memory at the peak: what this rank sends, what it receives, and
// the received ranges assembled once more (about 3x what it loads from others).
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::checkpoint {

// What the pieces a rank offers are of: the step and the world size they were made at, the
// checkpoint metadata that goes with them. A rank that holds nothing (one joining) passes {}.
struct HeldState {
  int64_t step = -1;
  int world_size = 0;
  std::map<std::string, std::string> metadata;
  std::vector<Piece> pieces;  // CPU, contiguous
};

struct PeerLoadStats {
  int64_t bytes_sent = 0;      // to other ranks
  int64_t bytes_received = 0;  // from other ranks
};

// Collective over `pg`: calls `load` (twice: Design note [state re-split from memory]) with a
// Reader over what every member holds. The Reader's step, world size and metadata are the lowest
// holding rank's; every holder must offer the same step (else an error naming both). A range no
// member holds is an error naming the key and elements.
PeerLoadStats load_from_peers(const comm::ProcessGroup& pg, const HeldState& held,
                              const std::function<void(const Reader&)>& load);

}  // namespace dtrain::checkpoint
