// TokenDataset (data/token_dataset.h): nanoGPT's flat uint16 files and Megatron's .bin/.idx pairs
// (written here byte by byte from the format, independently of write_indexed_tokens), windows over
// the shards' one stream (also across a shard boundary), splits, the pages it maps rather than
// reads, and the clear errors of corrupt, truncated or mismatched files and of tokens outside the
// vocabulary.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/data/token_dataset.h"
#include "dtrain/util/system.h"
#include "testing/testing.h"

using dtrain::data::TokenDataset;
using dtrain::testing::temp_dir;

namespace {

template <class T>
void append(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string flat(const std::vector<uint16_t>& tokens) {
  std::string s;
  for (auto t : tokens) append(s, t);
  return s;
}

// Megatron's MMIDIDX index of `lengths` (one document per sequence) of `bytes`-sized tokens of type `code`.
std::string megatron_index(const std::vector<int32_t>& lengths, uint8_t code, int bytes) {
  std::string s("MMIDIDX\0\0", 9);
  append(s, uint64_t{1});
  append(s, code);
  append(s, static_cast<uint64_t>(lengths.size()));
  append(s, static_cast<uint64_t>(lengths.size() + 1));
  for (auto l : lengths) append(s, l);
  int64_t at = 0;
  for (auto l : lengths) {
    append(s, at);
    at += int64_t{l} * bytes;
  }
  for (size_t i = 0; i <= lengths.size(); ++i) append(s, static_cast<int64_t>(i));
  return s;
}

std::vector<int64_t> row(const at::Tensor& t, int64_t r) {
  auto c = t[r].contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::string error_of(const std::string& path, int64_t seq_len, int64_t vocab = 0, int64_t read_sample = -1) {
  try {
    auto d = TokenDataset::open(path, seq_len, vocab);
    if (read_sample >= 0) d.batch({read_sample});
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST(TokenDataset, FlatFileWindowsAndSplit) {
  const std::string dir = temp_dir();
  std::vector<uint16_t> tokens;
  for (uint16_t i = 0; i < 23; ++i) tokens.push_back(static_cast<uint16_t>(1000 + i));
  write(dir + "/train.bin", flat(tokens));
  const auto d = TokenDataset::open(dir + "/train.bin", 4);
  EXPECT_EQ(d.num_tokens(), 23);
  EXPECT_EQ(d.size(), 5);  // windows of 5 tokens at 0, 4, ..., 16 (the 20th token starts none)
  auto [x, y] = d.batch({0, 4});
  EXPECT_EQ(row(x, 0), (std::vector<int64_t>{1000, 1001, 1002, 1003}));
  EXPECT_EQ(row(y, 0), (std::vector<int64_t>{1001, 1002, 1003, 1004}));
  EXPECT_EQ(row(x, 1), (std::vector<int64_t>{1016, 1017, 1018, 1019}));
  EXPECT_EQ(row(y, 1), (std::vector<int64_t>{1017, 1018, 1019, 1020}));
  EXPECT_EQ(x.scalar_type(), at::kLong);
  auto [train, val] = d.split(0.4);
  EXPECT_EQ(train.size(), 3);
  EXPECT_EQ(val.size(), 2);
  EXPECT_EQ(row(val.batch({0}).first, 0), (std::vector<int64_t>{1012, 1013, 1014, 1015}));
  EXPECT_EQ(row(train.batch({2}).second, 0), (std::vector<int64_t>{1009, 1010, 1011, 1012}));
}

TEST(TokenDataset, MegatronShardsAreOneStreamAcrossTheirBoundary) {
  const std::string dir = temp_dir();
  // Shard a: uint16 documents {1, 2, 3} and {4, 5}; shard b: int32 document {70000, 7, 8, 9}.
  write(dir + "/a.bin", flat({1, 2, 3, 4, 5}));
  write(dir + "/a.idx", megatron_index({3, 2}, 8, 2));
  std::string b;
  for (int32_t t : {70000, 7, 8, 9}) append(b, t);
  write(dir + "/b.bin", b);
  write(dir + "/b.idx", megatron_index({4}, 4, 4));
  const auto d = TokenDataset::open(dir, 3);
  EXPECT_EQ(d.num_tokens(), 9);
  EXPECT_EQ(d.num_documents(), 3);
  EXPECT_EQ(d.files().size(), 2u);
  ASSERT_EQ(d.size(), 2);
  auto [x, y] = d.batch({1});  // tokens 3..6: 4, 5 | 70000, 7
  EXPECT_EQ(row(x, 0), (std::vector<int64_t>{4, 5, 70000}));
  EXPECT_EQ(row(y, 0), (std::vector<int64_t>{5, 70000, 7}));
  // write_indexed_tokens writes the same bytes as the format written here.
  dtrain::data::write_indexed_tokens(dir + "/w", {{1, 2, 3}, {4, 5}});
  std::ifstream a_idx(dir + "/w.idx", std::ios::binary);
  const std::string written((std::istreambuf_iterator<char>(a_idx)), std::istreambuf_iterator<char>());
  EXPECT_EQ(written, megatron_index({3, 2}, 8, 2));
  EXPECT_EQ(TokenDataset::open(dir + "/w.bin", 2).batch({1}).first[0][0].item<int64_t>(), 3);
}

TEST(TokenDataset, MapsRatherThanReads) {
  // A sparse 1 GiB file: opening it and reading a window far in touches a page or two, never the
  // gigabyte (a dataset that read its file whole would need it all in memory).
  const std::string path = temp_dir() + "/big.bin";
  const int64_t tokens = int64_t{1} << 29, last = (tokens - 129) / 128 * 128 + 128;  // the last window's last token
  {
    std::ofstream f(path, std::ios::binary);
    f.seekp(2 * last);
    f.write("\x05\x00", 2);
    f.seekp(2 * tokens - 2);
    f.write("\x00\x00", 2);
  }
  const double before = dtrain::util::current_rss_mib();
  const auto d = TokenDataset::open(path, 128);
  EXPECT_EQ(d.num_tokens(), tokens);
  auto [x, y] = d.batch({d.size() - 1, 0, d.size() / 2});
  EXPECT_EQ(y[0][127].item<int64_t>(), 5);
  EXPECT_EQ(x[0][127].item<int64_t>(), 0);
  EXPECT_LT(dtrain::util::current_rss_mib() - before, 16.0) << "MiB resident after opening a 1 GiB token file";
}

TEST(TokenDataset, CorruptAndMismatchedFilesAreClearErrors) {
  const std::string dir = temp_dir();
  write(dir + "/odd.bin", std::string(9, '\0'));
  EXPECT_NE(error_of(dir + "/odd.bin", 2).find("has 9 bytes, not a whole number of uint16 tokens"), std::string::npos)
      << error_of(dir + "/odd.bin", 2);
  write(dir + "/m.bin", flat({1, 2, 3, 4, 5}));
  write(dir + "/m.idx", megatron_index({3, 3}, 8, 2));  // (says 6 tokens, the .bin has 5)
  EXPECT_NE(error_of(dir + "/m.bin", 2).find("is not the Megatron index of '" + dir + "/m.bin': its sequences take 12 bytes, the .bin has 10"),
            std::string::npos) << error_of(dir + "/m.bin", 2);
  std::string idx = megatron_index({5}, 8, 2);
  write(dir + "/m.idx", idx.substr(0, idx.size() - 3));
  EXPECT_NE(error_of(dir + "/m.bin", 2).find("(truncated?)"), std::string::npos) << error_of(dir + "/m.bin", 2);
  idx[0] = 'X';
  write(dir + "/m.idx", idx);
  EXPECT_NE(error_of(dir + "/m.bin", 2).find("it does not start with MMIDIDX"), std::string::npos);
  write(dir + "/m.idx", megatron_index({5}, 6, 2));
  EXPECT_NE(error_of(dir + "/m.bin", 2).find("token type 6 is not an integer type"), std::string::npos);
  write(dir + "/m.idx", megatron_index({5}, 8, 2));
  EXPECT_EQ(error_of(dir + "/m.bin", 2), "");
  EXPECT_NE(error_of(dir + "/m.bin", 2, /*vocab=*/4, /*read_sample=*/1).find("has token 4 at token 3, outside the model's vocabulary of 4"),
            std::string::npos) << error_of(dir + "/m.bin", 2, 4, 1);
  EXPECT_NE(error_of(dir + "/m.bin", 5).find("holds 5 tokens, fewer than one window of seq_len + 1 = 6"), std::string::npos);
  EXPECT_NE(error_of(dir + "/none.bin", 2).find("does not exist"), std::string::npos);
  EXPECT_NE(error_of(temp_dir(), 2).find("holds no .bin token files"), std::string::npos);
}
