#pragma once
// The data model of dtrain's training checkpoints: every strategy saves its state as pieces,
// contiguous ranges of named tensors. See docs/checkpoint.md.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::checkpoint {

// Design note [snapshots are views]
// ---------------------------------
// A checkpoint's snapshot (the pieces a strategy hands to checkpoint::save, the AsyncSaver or the
// PartnerSnapshots) refers to the live parameters and optimizer state: piece data are views, never
// copies (optim::state_dict_view, not state_dict_of). Each consumer copies or writes them before
// training changes them: save writes them before it returns, the AsyncSaver copies them into its
// reused host buffers (the parameters and optimizer state during the next step's forwards and
// backwards: Design note [a copy overlapped with the next step], async_saver.h), PartnerSnapshots
// packs them into its own. One copy per save, made by the
// consumer that needs it: a snapshot of the 146-MiB state of the state-heavy GPT cost 0.5 s when
// the optimizer's state was cloned first (fresh memory, page faults, then copied again).
//
// A contiguous range [begin, begin + data.numel()) of one named tensor, flattened in row-major order.
// Every strategy saves its state as pieces: a replicated tensor is split among ranks, a ZeRO owner saves
// whole tensors, an FSDP rank saves the ranges its flat shard covers. Loading asks for any range of any
// key and gets it assembled from whichever pieces overlap it, so a checkpoint loads at any world size.
struct Piece {
  std::string key;             // e.g. "model/blocks.0.fc.weight", "optim/blocks.0.fc.weight/exp_avg", "rng/cpu/rank0"
  std::vector<int64_t> shape;  // shape of the WHOLE tensor (may be {} for a 0-dim tensor)
  int64_t begin = 0;           // first flat element of this piece within the whole tensor
  at::Tensor data;             // 1-D (or any contiguous shape with numel = range length), CPU or not, dtype = the tensor's dtype
};

// Splits [0, numel) of a replicated tensor evenly among `world` ranks (comm::even_split from dtrain/comm/split.h)
// and returns this rank's piece (possibly empty -> returns std::nullopt): lets every rank write 1/W of replicated state.
std::optional<Piece> replicated_piece(std::string key, const at::Tensor& full, int rank, int world);

// For each of `pieces`, whether its data lie in the storage of one of `steady` (the tensors a
// consumer may copy later: Design note [a copy overlapped with the next step], async_saver.h).
std::vector<bool> in_storage_of(const std::vector<Piece>& pieces, const std::vector<at::Tensor>& steady);

// A piece holding the whole of `full` (begin 0): what a rank that alone owns a tensor saves
// (a ZeRO owner, rank-local state such as a per-rank RNG state).
Piece whole_piece(std::string key, const at::Tensor& full);

}  // namespace dtrain::checkpoint
