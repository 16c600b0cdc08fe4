// libFuzzer target: the manifest parser on arbitrary text. Every input must either parse into a
// manifest that encodes and parses back to the same encoding, or throw FormatError.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "dtrain/checkpoint/manifest.h"

using namespace dtrain::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Manifest m;
  try {
    m = parse_manifest(text, "fuzz/manifest.json");
  } catch (const FormatError&) {
    return 0;
  }
  for (const auto& [key, t] : m.tensors) {
    int64_t at = 0;
    for (const auto& p : t.pieces) {
      if (p.begin != at || p.numel < 1 || m.file(p.file) == nullptr) std::abort();
      at += p.numel;
    }
    if (at != t.numel()) std::abort();
  }
  try {
    const std::string encoded = encode_manifest(m);
    if (encode_manifest(parse_manifest(encoded, "fuzz/re-encoded")) != encoded) std::abort();
  } catch (const FormatError&) {
    std::abort();
  }
  return 0;
}
