#include "dtrain/checkpoint/piece.h"

#include <unordered_set>

#include <c10/util/Exception.h>

#include "dtrain/comm/split.h"

namespace dtrain::checkpoint {

std::vector<bool> in_storage_of(const std::vector<Piece>& pieces, const std::vector<at::Tensor>& steady) {
  std::unordered_set<const void*> storages;
  for (const at::Tensor& t : steady) {
    if (t.defined() && t.has_storage()) storages.insert(t.storage().unsafeGetStorageImpl());
  }
  std::vector<bool> out;
  out.reserve(pieces.size());
  for (const Piece& p : pieces) out.push_back(p.data.has_storage() && storages.count(p.data.storage().unsafeGetStorageImpl()));
  return out;
}

std::optional<Piece> replicated_piece(std::string key, const at::Tensor& full, int rank, int world) {
  TORCH_CHECK(full.defined(), "replicated_piece(\"", key, "\"): the tensor is undefined");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "replicated_piece(\"", key, "\"): rank ", rank,
              " is not in a world of ", world);
  const auto counts = comm::even_split(full.numel(), world);
  const auto offsets = comm::offsets_of(counts);
  // A tensor without elements is recorded by rank 0 (an empty piece carries its shape and dtype).
  if (counts[rank] == 0 && !(full.numel() == 0 && rank == 0)) return std::nullopt;
  Piece p;
  p.key = std::move(key);
  p.shape = full.sizes().vec();
  p.begin = offsets[rank];
  p.data = full.reshape({-1}).narrow(0, offsets[rank], counts[rank]);
  return p;
}

Piece whole_piece(std::string key, const at::Tensor& full) {
  TORCH_CHECK(full.defined(), "whole_piece(\"", key, "\"): the tensor is undefined");
  return Piece{std::move(key), full.sizes().vec(), 0, full};
}

}  // namespace dtrain::checkpoint
