// Sha256's two block functions: the portable code and SHA-NI (x86 SHA extensions). Both must give the
// FIPS 180-4 digests, and the same digest for any data fed in any chunks. The SHA-NI tests skip on a
// CPU without it; the portable path is forced through sha256.h's test hook.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "dtrain/checkpoint/sha256.h"

using namespace dtrain::checkpoint;

namespace {

// The test hooks, qualified in full: the tests are unity-built, and another file's using-directive
// could make a bare detail:: ambiguous.
bool sha_ni_in_use() { return dtrain::checkpoint::detail::sha256_accelerated(); }
void force_portable_sha256(bool force) { dtrain::checkpoint::detail::sha256_force_portable(force); }

// Forces the portable code while alive (the hook is process-wide: restored even when a test fails).
struct PortableSha256Scope {
  PortableSha256Scope() { force_portable_sha256(true); }
  ~PortableSha256Scope() { force_portable_sha256(false); }
};

void expect_fips_180_4_vectors() {
  EXPECT_EQ(sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(sha256_hex(two_blocks.data(), two_blocks.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  EXPECT_EQ(sha256_hex(million.data(), million.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// The digest of data[0, n) fed in random chunks of 0..max_chunk bytes.
std::string digest_in_random_chunks(const std::vector<uint8_t>& data, size_t n, size_t max_chunk, std::mt19937& rng) {
  Sha256 h;
  for (size_t at = 0; at < n;) {
    const size_t take = std::min(n - at, static_cast<size_t>(rng() % (max_chunk + 1)));
    h.update(data.data() + at, take);
    at += take;
  }
  return h.hex_digest();
}

}  // namespace

TEST(Sha256Paths, PortableCodeGivesTheFipsVectors) {
  PortableSha256Scope portable;
  EXPECT_FALSE(sha_ni_in_use());
  expect_fips_180_4_vectors();
}

TEST(Sha256Paths, ShaNiGivesTheFipsVectors) {
  if (!sha_ni_in_use()) GTEST_SKIP() << "this CPU has no SHA-NI";
  expect_fips_180_4_vectors();
}

// Every length 0..300 covers each split of a message into blocks, the padding's one- and two-block
// cases and the buffered partial block; the large lengths cover long runs of whole blocks.
TEST(Sha256Paths, ShaNiAndPortableCodeAgreeForAnyLengthAndChunks) {
  if (!sha_ni_in_use()) GTEST_SKIP() << "this CPU has no SHA-NI";
  const std::vector<uint8_t> data = random_bytes(3 << 20, 7);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {4095, 4096, 65537, (1 << 20) + 3, 3 << 20}) lengths.push_back(n);
  std::mt19937 rng(11);
  for (size_t n : lengths) {
    const size_t max_chunk = n < 1000 ? 150 : 70000;
    const std::string accelerated = digest_in_random_chunks(data, n, max_chunk, rng);
    const std::string accelerated_whole = sha256_hex(data.data(), n);
    PortableSha256Scope portable;
    EXPECT_EQ(digest_in_random_chunks(data, n, max_chunk, rng), accelerated) << "length " << n;
    EXPECT_EQ(sha256_hex(data.data(), n), accelerated_whole) << "length " << n;
    EXPECT_EQ(accelerated, accelerated_whole) << "length " << n;
  }
}

// Both paths keep the state in h_'s order, so one object may switch between update() calls.
TEST(Sha256Paths, SwitchingPathsBetweenUpdatesKeepsTheDigest) {
  if (!sha_ni_in_use()) GTEST_SKIP() << "this CPU has no SHA-NI";
  const std::vector<uint8_t> data = random_bytes(10000, 3);
  const std::string whole = sha256_hex(data.data(), data.size());
  Sha256 h;
  for (size_t at = 0, i = 0; at < data.size(); at += 1000, ++i) {
    force_portable_sha256(i % 2 == 1);
    h.update(data.data() + at, std::min<size_t>(1000, data.size() - at));
  }
  force_portable_sha256(false);
  EXPECT_EQ(h.hex_digest(), whole);
}
