// libFuzzer target: the safetensors header parser on arbitrary file bytes. Every input must either
// parse into a header that satisfies the format's invariants or throw FormatError; anything else
// (another exception, a sanitizer report, a failed invariant) is a bug.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "dtrain/checkpoint/safetensors.h"

using namespace dtrain::checkpoint;

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  SafetensorsHeader h;
  try {
    h = parse_safetensors_prefix(bytes, size, "fuzz.safetensors");
  } catch (const FormatError&) {
    return 0;
  }
  require(h.buffer_offset == 8 + h.header_bytes && h.buffer_offset + h.buffer_bytes == size);
  uint64_t at = 0;
  for (const auto& e : h.entries) {
    require(e.begin == at && e.begin <= e.end && e.end <= h.buffer_bytes);
    require(e.numel() >= 0 && static_cast<uint64_t>(e.numel()) * dtype_size(e.dtype) == e.end - e.begin);
    require(h.find(e.name) != nullptr);
    at = e.end;
  }
  require(at == h.buffer_bytes);
  // What parses lays out again (in offset order) to the same offsets.
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& e : h.entries) specs.push_back({e.name, e.dtype, e.shape});
  try {
    const auto again = lay_out_safetensors(specs, h.metadata, nullptr, "fuzz.safetensors");
    for (size_t i = 0; i < h.entries.size(); ++i) require(again.entries[i].end == h.entries[i].end);
  } catch (const FormatError&) {
    std::abort();
  }
  return 0;
}
