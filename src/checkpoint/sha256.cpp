#include "dtrain/checkpoint/sha256.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define DTRAIN_SHA256_X86 1
#endif

namespace dtrain::checkpoint {

namespace {

alignas(16) constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

#ifdef DTRAIN_SHA256_X86
// SHA-NI: the technique of Intel's white paper "Intel SHA Extensions: New Instructions Supporting
// the Secure Hash Algorithm on Intel Architecture Processors" (Gulley et al., 2013) and of the
// public-domain intrinsics code that follows it (Jeffrey Walton's SHA-Intrinsics, sha256-x86.c).
// sha256rnds2 does two rounds on a state split into two registers, ABEF and CDGH (not h_'s
// ABCD/EFGH order: converted once per call, so a run of blocks pays it once); it takes the round's
// W + K in the low two lanes of its third operand. sha256msg1/msg2 extend the message schedule four
// words at a time: W[t..t+3] = msg2(msg1(W[t-16..], W[t-12..]) + W[t-7..t-4], W[t-4..]). Only
// these functions are compiled for the SHA and SSE4.1 instruction sets (target attributes, no
// global -msha), and they run only where cpu_has_sha_ni() says so.
#define DTRAIN_SHA_TARGET __attribute__((target("sha,sse4.1")))

// Four rounds: t = 4 * quad, w = W[t..t+3].
DTRAIN_SHA_TARGET inline void four_rounds(__m128i& abef, __m128i& cdgh, __m128i w, int quad) {
  const __m128i wk = _mm_add_epi32(w, _mm_load_si128(reinterpret_cast<const __m128i*>(kK + 4 * quad)));
  cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
  abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));  // rounds t+2, t+3: lanes 2, 3 down
}

// One 64-byte block into abef/cdgh. m[q & 3] holds W[4q..4q+3] of the last four quads.
DTRAIN_SHA_TARGET inline void sha_ni_block(__m128i& abef, __m128i& cdgh, const uint8_t* p) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);  // big-endian words
  const __m128i abef0 = abef, cdgh0 = cdgh;
  __m128i m[4];
#pragma GCC unroll 16  // the m[q & 3] indices must become registers
  for (int q = 0; q < 16; ++q) {
    if (q < 4) {
      m[q] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q)), bswap);
    } else {
      const __m128i w7 = _mm_alignr_epi8(m[(q - 1) & 3], m[(q - 2) & 3], 4);  // W[t-7..t-4]
      m[q & 3] = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(m[q & 3], m[(q - 3) & 3]), w7),
                                      m[(q - 1) & 3]);
    }
    four_rounds(abef, cdgh, m[q & 3], q);
  }
  abef = _mm_add_epi32(abef, abef0);
  cdgh = _mm_add_epi32(cdgh, cdgh0);
}

DTRAIN_SHA_TARGET void sha_ni_blocks(uint32_t* h, const uint8_t* p, size_t n) {
  const __m128i dcba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));  // lane 0 = A
  const __m128i hgfe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 4));
  const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
  for (; n > 0; --n, p += 64) sha_ni_block(abef, cdgh, p);
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm_blend_epi16(feba, dchg, 0xF0));  // ABCD
  _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 4), _mm_alignr_epi8(dchg, feba, 8));  // EFGH
}

// CPUID directly: clang 14 (fuzz/run.sh) does not know __builtin_cpu_supports("sha"). SSSE3
// (pshufb) and SSE4.1 (pblendw) are checked too: a virtual machine may hide features one by one.
bool cpu_has_sha_ni() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSSE3) || !(c & bit_SSE4_1)) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b & bit_SHA) != 0;
}
#undef DTRAIN_SHA_TARGET  // (the library is a unity build: keep macros out of the next file)
#else
bool cpu_has_sha_ni() { return false; }
#endif

std::atomic<bool> sha256_portable_forced{false};

// The CPU is asked once; the test hook's flag on every call (one relaxed load per run of blocks).
bool use_sha_ni() {
  static const bool has = cpu_has_sha_ni();
  return has && !sha256_portable_forced.load(std::memory_order_relaxed);
}

}  // namespace

namespace detail {
bool sha256_accelerated() { return use_sha_ni(); }
void sha256_force_portable(bool force) { sha256_portable_forced.store(force, std::memory_order_relaxed); }
}  // namespace detail

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const uint8_t* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) {
    w[i] = (uint32_t(p[4 * i]) << 24) | (uint32_t(p[4 * i + 1]) << 16) | (uint32_t(p[4 * i + 2]) << 8) |
           uint32_t(p[4 * i + 3]);
  }
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[i] + w[i];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a;
  h_[1] += b;
  h_[2] += c;
  h_[3] += d;
  h_[4] += e;
  h_[5] += f;
  h_[6] += g;
  h_[7] += h;
}

void Sha256::blocks(const uint8_t* p, size_t n) {
#ifdef DTRAIN_SHA256_X86
  if (use_sha_ni()) {
    sha_ni_blocks(h_.data(), p, n);
    return;
  }
#endif
  for (; n > 0; --n, p += 64) block(p);
}

void Sha256::update(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_ += bytes;
  if (buf_len_ > 0) {
    const size_t take = std::min(bytes, 64 - buf_len_);
    std::memcpy(buf_.data() + buf_len_, p, take);
    buf_len_ += take;
    p += take;
    bytes -= take;
    if (buf_len_ < 64) return;
    blocks(buf_.data(), 1);
    buf_len_ = 0;
  }
  if (bytes >= 64) {  // all whole blocks in one call: SHA-NI converts its state once per call
    blocks(p, bytes / 64);
    p += bytes / 64 * 64;
    bytes %= 64;
  }
  if (bytes > 0) {
    std::memcpy(buf_.data(), p, bytes);
    buf_len_ = bytes;
  }
}

std::array<uint8_t, 32> Sha256::digest() {
  const uint64_t bits = total_ * 8;
  const uint8_t pad = 0x80;
  update(&pad, 1);
  const uint8_t zero = 0;
  while (buf_len_ != 56) update(&zero, 1);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  update(len, 8);
  std::array<uint8_t, 32> out;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
  }
  return out;
}

std::string Sha256::hex_digest() {
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : digest()) {
    s += kHex[b >> 4];
    s += kHex[b & 15];
  }
  return s;
}

std::string sha256_hex(const void* data, size_t bytes) {
  Sha256 h;
  h.update(data, bytes);
  return h.hex_digest();
}

}  // namespace dtrain::checkpoint

#undef DTRAIN_SHA256_X86
