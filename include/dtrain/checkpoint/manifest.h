#pragma once
// manifest.json of a checkpoint directory, plain C++ without libtorch (fuzzed in fuzz/).
//
// {
//   "format": "dtrain-checkpoint", "format_version": 2,
//   "content_sha256": "<64 hex>",    (SHA-256 of this manifest encoded without this field)
//   "step": 12, "world_size": 3,
//   "metadata": {"strategy": "fsdp", ...},                      (string -> string)
//   "files": [{"name": "rank-00000.safetensors", "size": 4096, "sha256": "<64 hex>"}, ...],
//   "tensors": {
//     "model/fc.weight": {"shape": [4, 3], "dtype": "F32",
//                         "pieces": [{"file": "rank-00000.safetensors", "tensor": "model/fc.weight@0",
//                                     "begin": 0, "numel": 6}, ...]},
//     ...}
// }
//
// parse_manifest validates everything that does not need the tensor files: known fields only,
// no duplicate keys, file names plain (no '/', not starting with '.') and unique, sizes
// non-negative, hashes 64 lowercase hex digits, dtypes known, shapes non-negative, every piece in
// a listed file, no (file, tensor) used twice, and the pieces of each key covering [0, numel)
// exactly once, and (format_version 2) content_sha256 equal to the SHA-256 of the manifest's
// canonical encoding without it, so that a changed value anywhere in it (a metadata string, a size,
// a piece) is an error at load, like a changed byte of a tensor file. Version 1 manifests (written
// before the field existed) are read without that check. Errors are FormatError naming `where` and
// the field; they quote no bytes of a file that is not a dtrain manifest.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dtrain/checkpoint/safetensors.h"

namespace dtrain::checkpoint {

inline constexpr const char* kManifestFormat = "dtrain-checkpoint";
inline constexpr int64_t kManifestFormatVersion = 2;  // written; 1 and 2 are read
inline constexpr const char* kManifestFileName = "manifest.json";

struct ManifestFile {
  std::string name;    // relative to the checkpoint directory, e.g. "rank-00003.safetensors"
  uint64_t size = 0;   // bytes
  std::string sha256;  // lowercase hex
};

struct ManifestPiece {
  std::string file;    // a ManifestFile name
  std::string tensor;  // the tensor's name inside that safetensors file
  int64_t begin = 0;   // first flat element within the whole tensor
  int64_t numel = 0;   // > 0
};

struct ManifestTensor {
  std::vector<int64_t> shape;
  Dtype dtype = Dtype::F32;
  std::vector<ManifestPiece> pieces;  // sorted by begin, covering [0, numel) exactly once
  int64_t numel() const;
};

struct Manifest {
  int64_t format_version = kManifestFormatVersion;
  int64_t step = 0;
  int64_t world_size = 1;
  std::map<std::string, std::string> metadata;
  std::vector<ManifestFile> files;
  std::map<std::string, ManifestTensor> tensors;
  // The file named `name`, or nullptr.
  const ManifestFile* file(std::string_view name) const;
};

// Parses and validates; `where` names the manifest in errors (e.g. "ckpt/step-00000012/manifest.json").
Manifest parse_manifest(std::string_view json, const std::string& where);
// The checks parse_manifest makes, on a manifest built in memory (sorts each tensor's pieces).
void validate_manifest(Manifest& manifest, const std::string& where);
// Pretty-printed JSON (format_version 2, with content_sha256) that parse_manifest reads back to an
// equal manifest.
std::string encode_manifest(const Manifest& manifest);
// The content_sha256 of a manifest: SHA-256 of its canonical encoding without that field.
std::string manifest_content_sha256(const Manifest& manifest);

}  // namespace dtrain::checkpoint
