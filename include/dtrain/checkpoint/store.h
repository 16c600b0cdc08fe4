#pragma once
// Sharded, atomic, validated training checkpoints (storage layer). See docs/checkpoint.md.
//
// Layout under a root directory:
//   root/step-00000012/rank-00000.safetensors ... rank-<W-1>.safetensors   (one file per saving rank)
//   root/step-00000012/manifest.json                                       (what lies where, hashes)
//   root/latest                                                            ("step-00000012")
// A checkpoint is written into root/step-00000012.tmp-<nonce>/ and becomes visible only by a
// rename after every byte is fsynced; `latest` is replaced the same way. Reading validates every
// field of the manifest and of the file headers, and each file's SHA-256, before using any byte.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include "dtrain/checkpoint/piece.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::checkpoint {

struct SaveOptions {
  TORCH_ARG(int64_t, keep_last) = 2;   // completed checkpoints kept under root (older ones deleted after commit); 0 = keep all
  TORCH_ARG(bool, fsync) = true;
};

// Collective over `pg` (every rank calls it with its own pieces): writes checkpoint `step` under `root`:
//   root/step-00000012.tmp-<nonce>/rank-00003.safetensors   (each rank writes its own file, in parallel)
//   root/step-00000012.tmp-<nonce>/manifest.json             (rank 0, after gathering every rank's index)
// then rank 0 fsyncs files + dir, renames the directory to root/step-00000012, and updates root/latest
// (a small file holding "step-00000012", replaced by write-temp + fsync + rename). A crash at any point
// leaves the previous checkpoint as what `latest` names. Before committing, rank 0 checks that for every
// key the pieces of all ranks cover [0, numel) exactly once with equal shape/dtype (error names the key
// and the ranks). `metadata`: small string->string values (JSON-able), stored in the manifest; every rank
// must pass the same metadata (rank 0's is stored). Returns the committed directory. Errors on any rank
// are reported on every rank (no hang: agree on success with a small collective before the commit).
// `root` must be a directory every rank can see (a shared file system for several machines).
std::string save(const std::string& root, int64_t step, const comm::ProcessGroup& pg,
                 const std::vector<Piece>& pieces, const std::map<std::string, std::string>& metadata,
                 const SaveOptions& options = {});

// What a run of saves agrees once (Design note [a cached save plan], store.cpp): after the first
// save through it, a save runs no collective before its files are written, only the commit's
// agreement (every rank's file index to rank 0, then the outcome to every rank).
struct SavePlanCache {
  std::string nonce;  // the temporary directories' suffix, agreed by the first save ("": none yet)
};
std::string save(const std::string& root, int64_t step, const comm::ProcessGroup& pg,
                 const std::vector<Piece>& pieces, const std::map<std::string, std::string>& metadata,
                 const SaveOptions& options, SavePlanCache& cache);

// root/latest's checkpoint directory, or nullopt if there is none yet. Throws if `latest` names a missing dir.
std::optional<std::string> latest(const std::string& root);

// The committed checkpoint directories under `root` (named step-NNNNNNNN), newest first, whether or
// not `latest` names them (leftovers of interrupted saves are not listed).
std::vector<std::string> committed_checkpoints(const std::string& root);

// "step-00000012" for step 12: the name of a committed checkpoint directory under its root.
std::string step_dir_name(int64_t step);

struct TensorInfo {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  int64_t numel() const;
};

// A committed checkpoint, opened read-only: manifest parsed and fully validated; file headers validated
// on first use; each file's SHA-256 (from the manifest) checked when it is first read (before any byte of it
// is used). Thread-compatible (one reader per thread).
class Reader {
 public:
  // `path`: a checkpoint directory (root/step-...) or a root containing `latest`.
  static Reader open(const std::string& path);

  // A checkpoint held in memory, not on disk (Design note [state re-split from memory],
  // peer_load.h): `tensors` says what it holds (key -> whole shape and dtype), `fill` writes
  // elements [begin, end) of a key (within its range: the reader checks) to `dst`, contiguous, in
  // the key's dtype. dir() is "(in memory)"; verify_files checks nothing.
  using Fill = std::function<void(const std::string& key, int64_t begin, int64_t end, char* dst)>;
  static Reader in_memory(int64_t step, int world_size, std::map<std::string, std::string> metadata,
                          const std::map<std::string, TensorInfo>& tensors, Fill fill);

  const std::string& dir() const;
  int64_t step() const;
  const std::map<std::string, std::string>& metadata() const;
  bool has(const std::string& key) const;
  std::vector<std::string> keys() const;                // sorted
  std::vector<std::string> keys_with_prefix(const std::string& prefix) const;
  TensorInfo info(const std::string& key) const;        // throws naming the key if absent
  // Elements [begin, end) of `key`, flattened, assembled from the pieces that overlap (any ranks' files). 1-D CPU tensor.
  at::Tensor read(const std::string& key, int64_t begin, int64_t end) const;
  // The whole tensor with its shape.
  at::Tensor read(const std::string& key) const;
  // Reads into an existing tensor (shape and dtype must equal info(key), else a clear error naming the key).
  void read_into(const std::string& key, at::Tensor& out) const;
  int saved_world_size() const;
  // Checks the files i with i % parts == part now (size, SHA-256, header against the manifest),
  // instead of at their first read: `parts` ranks together check a whole checkpoint once before
  // resuming from it. Throws as a read of a damaged file would.
  void verify_files(int part, int parts) const;

  Reader(Reader&&) noexcept;
  Reader& operator=(Reader&&) noexcept;
  ~Reader();

 private:
  struct State;
  explicit Reader(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace dtrain::checkpoint
