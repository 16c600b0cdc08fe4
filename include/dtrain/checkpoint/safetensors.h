#pragma once
// The safetensors file format (https://github.com/huggingface/safetensors), plain C++ without
// libtorch so that the parser can be fuzzed on its own (fuzz/):
//
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8 + N)    UTF-8 JSON: {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
//                                    ..., "__metadata__": {"<key>": "<string>", ...}}
//                       (dtrain pads it with spaces so the buffer starts 8-byte aligned)
//   bytes [8 + N, end)  the buffer; each tensor's bytes are [b, e) relative to its start, row-major,
//                       little-endian
//
// parse_safetensors_header validates every field and throws FormatError naming the file and the
// field: header length within the file, well-formed JSON without duplicate keys, known dtypes,
// non-negative shapes whose numel * itemsize equals the offset range, offsets inside the buffer,
// and the tensors, sorted by offset, covering the buffer exactly (no overlap, no hole).
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::checkpoint {

// A malformed file, manifest or header. what() names the file and the field. The libtorch-facing
// layer (store.h) reports these as c10::Error with the same text.
class FormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The element types safetensors files hold (their names in the format: "F64", "F32", ...).
enum class Dtype {
  F64,   // double
  F32,   // float
  F16,   // IEEE half
  BF16,  // bfloat16
  I64,   // int64
  I32,   // int32
  I16,   // int16
  I8,    // int8
  U8,    // uint8
  BOOL,  // one byte, 0 or 1
};
const char* dtype_name(Dtype dtype);
std::optional<Dtype> dtype_from_name(std::string_view name);
int64_t dtype_size(Dtype dtype);  // bytes per element

// Product of `shape` (1 for {}), or nullopt if a dimension is negative or the product overflows int64.
std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape);
// "[2, 3]"
std::string shape_string(const std::vector<int64_t>& shape);

// Header lengths above this are rejected (the limit the safetensors library uses: 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
// The "__metadata__" entry's name.
inline constexpr const char* kSafetensorsMetadataKey = "__metadata__";

struct SafetensorsEntry {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // data_offsets, relative to the buffer start
  uint64_t end = 0;
  int64_t numel() const;  // checked by the parser, so it cannot overflow
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;   // N
  uint64_t buffer_offset = 0;  // 8 + N: where the buffer starts in the file
  uint64_t buffer_bytes = 0;   // file size - 8 - N
  std::vector<SafetensorsEntry> entries;  // sorted by offset (then name)
  std::map<std::string, std::string> metadata;
  // The entry named `name`, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const;
};

// N from the first 8 bytes of a `file_size`-byte file; checks 8 + N <= file_size and N <= the limit.
// `file` only names the file in errors.
uint64_t parse_safetensors_header_length(const unsigned char* first8, uint64_t file_size,
                                         const std::string& file);
// Parses and validates the header JSON (the N bytes after the length) of a `file_size`-byte file.
SafetensorsHeader parse_safetensors_header(std::string_view header_json, uint64_t file_size,
                                           const std::string& file);
// Both steps on the first bytes of a file (at least 8 + N of them; more are ignored).
SafetensorsHeader parse_safetensors_prefix(std::string_view file_prefix, uint64_t file_size,
                                           const std::string& file);

// What a writer knows in advance about one tensor.
struct SafetensorsTensorSpec {
  std::string name;
  Dtype dtype = Dtype::F32;
  std::vector<int64_t> shape;
};
// Lays the tensors out back to back in the given order and returns the header (entries in that
// order) plus, in `prefix`, the bytes that start the file (length + JSON padded to a multiple of 8).
// Throws FormatError for duplicate or reserved names, negative dims or overflowing sizes.
SafetensorsHeader lay_out_safetensors(const std::vector<SafetensorsTensorSpec>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      std::string* prefix, const std::string& file);

}  // namespace dtrain::checkpoint
