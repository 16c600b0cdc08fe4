#include "dtrain/data/token_writer.h"

#include <cstdint>
#include <fstream>
#include <stdexcept>

namespace dtrain::data {

void write_indexed_tokens(const std::string& prefix, const std::vector<std::vector<int64_t>>& documents) {
  bool small = true;
  for (const auto& d : documents) {
    for (int64_t t : d) {
      if (t < 0 || t > INT32_MAX) throw std::invalid_argument("write_indexed_tokens: token " + std::to_string(t) + " does not fit a token file");
      small = small && t <= UINT16_MAX;
    }
  }
  const int bytes = small ? 2 : 4;
  const uint8_t code = small ? 8 : 4;
  std::ofstream bin(prefix + ".bin", std::ios::binary), idx(prefix + ".idx", std::ios::binary);
  if (!bin || !idx) throw std::runtime_error("write_indexed_tokens: cannot write '" + prefix + ".bin' and '.idx'");
  auto put = [](std::ofstream& f, const auto& v) { f.write(reinterpret_cast<const char*>(&v), sizeof v); };
  for (const auto& d : documents) {
    for (int64_t t : d) {
      if (small) put(bin, static_cast<uint16_t>(t)); else put(bin, static_cast<int32_t>(t));
    }
  }
  idx.write(kMegatronIndexMagic, 9);
  put(idx, uint64_t{1});
  put(idx, code);
  put(idx, static_cast<uint64_t>(documents.size()));
  put(idx, static_cast<uint64_t>(documents.size() + 1));
  for (const auto& d : documents) put(idx, static_cast<int32_t>(d.size()));
  int64_t pointer = 0;
  for (const auto& d : documents) {
    put(idx, pointer);
    pointer += static_cast<int64_t>(d.size()) * bytes;
  }
  for (size_t i = 0; i <= documents.size(); ++i) put(idx, static_cast<int64_t>(i));
  bin.flush();
  idx.flush();
  if (!bin || !idx) throw std::runtime_error("write_indexed_tokens: writing '" + prefix + ".bin' and '.idx' failed");
}

}  // namespace dtrain::data
