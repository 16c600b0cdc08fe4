#pragma once
// SHA-256 (FIPS 180-4), a small self-contained implementation for checkpoint integrity hashes.
// On x86 CPUs with the SHA extensions (SHA-NI) whole blocks go through those instructions (several
// times the portable code's speed); elsewhere the portable code runs. The choice is made at run time.
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
  // n consecutive 64-byte blocks at p into h_: SHA-NI where the CPU has it, else block() n times.
  void blocks(const uint8_t* p, size_t n);
  void block(const uint8_t* p);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_;
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

// SHA-256 of `bytes` as hex.
std::string sha256_hex(const void* data, size_t bytes);

namespace detail {
// Test hooks, so that one machine can check both paths against each other. sha256_accelerated():
// whether Sha256 uses SHA-NI now (the CPU has it and the portable code is not forced).
// sha256_force_portable(true) makes every Sha256 use the portable code until called with false
// (process-wide; switching between two update() calls of one object is safe: both keep h_ alike).
bool sha256_accelerated();
void sha256_force_portable(bool force);
}  // namespace detail

}  // namespace dtrain::checkpoint
