#pragma once
// SHA-256 (FIPS 180-4), a small self-contained implementation for checkpoint integrity hashes.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::checkpoint {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  // The digest of everything passed to update(); the object must not be updated afterwards.
  std::array<uint8_t, 32> digest();
  // digest() as 64 lowercase hex digits.
  std::string hex_digest();

 private:
  void block(const uint8_t* p);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_;
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

// SHA-256 of `bytes` as hex.
std::string sha256_hex(const void* data, size_t bytes);

}  // namespace dtrain::checkpoint
