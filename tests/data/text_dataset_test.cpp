// TextDataset: byte windows, batches, splits, directory loading and errors.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/data/text_dataset.h"
#include "dtrain/util/fs.h"
#include "testing/testing.h"

namespace {

using dtrain::data::TextDataset;
namespace fs = dtrain::util::fs;

void write_file(const std::string& p, const std::string& content) {
  std::ofstream out(p, std::ios::binary);
  out << content;
}

void expect_dataset_error(const std::function<void()>& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

std::string alphabet(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += static_cast<char>('a' + i % 26);
  return s;
}

TEST(TextDataset, WindowsAreShiftedByOne) {
  TextDataset ds(alphabet(20), /*seq_len=*/4);  // stride 4: (20 - 5) / 4 + 1 = 4 windows
  EXPECT_EQ(ds.seq_len(), 4);
  EXPECT_EQ(ds.stride(), 4);
  EXPECT_EQ(ds.num_bytes(), 20);
  ASSERT_EQ(ds.size(), 4);
  auto [x, y] = ds.get(1);
  EXPECT_EQ(x.scalar_type(), at::kLong);
  EXPECT_EQ(x.sizes(), (std::vector<int64_t>{4}));
  EXPECT_TRUE(at::equal(x, at::tensor({'e', 'f', 'g', 'h'}, at::kLong)));
  EXPECT_TRUE(at::equal(y, at::tensor({'f', 'g', 'h', 'i'}, at::kLong)));
  auto [x3, y3] = ds.get(3);  // bytes 12..16
  EXPECT_EQ(y3[3].item<int64_t>(), 'q');
}

TEST(TextDataset, StrideAndSizeFormula) {
  for (int64_t len : {5, 6, 9, 10, 33}) {
    for (int64_t stride : {1, 2, 3, 4, 7}) {
      TextDataset ds(alphabet(static_cast<int>(len)), 4, stride);
      EXPECT_EQ(ds.size(), (len - 5) / stride + 1) << len << " " << stride;
      // the last window fits, the next would not
      const int64_t last = ds.size() - 1;
      EXPECT_LE(last * stride + 5, len);
      EXPECT_GT((last + 1) * stride + 5, len);
      auto [x, y] = ds.get(last);
      EXPECT_EQ(x[0].item<int64_t>(), 'a' + (last * stride) % 26);
    }
  }
}

TEST(TextDataset, BatchStacksSamplesAndKeepsHighBytes) {
  std::string text;
  for (int i = 0; i < 256; ++i) text += static_cast<char>(i);  // bytes >= 128 must stay >= 0
  TextDataset ds(text, 8);
  ASSERT_EQ(ds.size(), 31);  // (256 - 9) / 8 + 1
  auto [xs, ys] = ds.batch({0, 30, 5, 5});
  EXPECT_EQ(xs.sizes(), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(ys.sizes(), (std::vector<int64_t>{4, 8}));
  EXPECT_TRUE(xs.is_contiguous() && ys.is_contiguous());
  EXPECT_TRUE(at::equal(xs[0], at::arange(0, 8, at::kLong)));
  EXPECT_TRUE(at::equal(xs[1], at::arange(240, 248, at::kLong)));
  EXPECT_TRUE(at::equal(ys[1], at::arange(241, 249, at::kLong)));
  EXPECT_TRUE(at::equal(xs[2], xs[3]));
  auto [x5, y5] = ds.get(5);
  EXPECT_TRUE(at::equal(x5, xs[2]));
  EXPECT_TRUE(at::equal(y5, ys[2]));
  auto [ex, ey] = ds.batch({});
  EXPECT_EQ(ex.sizes(), (std::vector<int64_t>{0, 8}));
}

TEST(TextDataset, SplitHoldsOutTheTail) {
  TextDataset ds(alphabet(1000), 9);
  auto [train, val] = ds.split(0.05);
  EXPECT_EQ(val.num_bytes(), 50);
  EXPECT_EQ(train.num_bytes(), 950);
  EXPECT_EQ(train.seq_len(), 9);
  EXPECT_EQ(val.stride(), 9);
  EXPECT_EQ(std::string(val.bytes()), alphabet(1000).substr(950));
  EXPECT_EQ(val.size(), (50 - 10) / 9 + 1);
  auto [vx, vy] = val.get(0);
  EXPECT_EQ(vx[0].item<int64_t>(), 'a' + 950 % 26);
  // a tiny fraction still holds out one full window
  auto [t2, v2] = ds.split(0.001);
  EXPECT_EQ(v2.num_bytes(), 10);
  EXPECT_EQ(v2.size(), 1);
  expect_dataset_error([&] { ds.split(0.0); }, "val_fraction must be in (0, 1)");
  expect_dataset_error([&] { ds.split(1.0); }, "val_fraction must be in (0, 1)");
  expect_dataset_error([] { TextDataset(alphabet(15), 9).split(0.5); }, "too few");
}

TEST(TextDataset, LoadsFileAndSortedDirectory) {
  const std::string dir = dtrain::testing::temp_dir();
  write_file(dir + "/b.txt", "BBBB");
  write_file(dir + "/a.txt", "AAAA");
  write_file(dir + "/c.txt", "CC");
  ASSERT_EQ(fs::create_directory(dir + "/sub"), 0);  // not recursed into
  write_file(dir + "/sub/z.txt", "ZZZZZZ");
  ASSERT_EQ(fs::create_symlink(dir + "/a.txt", dir + "/d-link"), 0);  // same file again: read once
  EXPECT_EQ(dtrain::data::read_text_bytes(dir), "AAAABBBBCC");
  EXPECT_EQ(dtrain::data::read_text_bytes(dir + "/c.txt"), "CC");

  auto ds = TextDataset::from_path(dir, 3);
  EXPECT_EQ(ds.num_bytes(), 10);
  EXPECT_EQ(ds.size(), 3);  // (10 - 4) / 3 + 1
  auto [x, y] = ds.get(2);
  EXPECT_TRUE(at::equal(x, at::tensor({'B', 'B', 'C'}, at::kLong)));
  EXPECT_TRUE(at::equal(y, at::tensor({'B', 'C', 'C'}, at::kLong)));
}

TEST(TextDataset, DefaultCorpusIsUsable) {
  if (!fs::is_directory(dtrain::data::kDefaultTextCorpus)) GTEST_SKIP() << "no default corpus";
  auto ds = TextDataset::from_path(dtrain::data::kDefaultTextCorpus, 128);
  EXPECT_GT(ds.num_bytes(), 100000);
  auto [train, val] = ds.split(0.05);
  EXPECT_GT(val.size(), 10);
  auto [x, y] = train.batch({0, 1});
  EXPECT_LT(x.max().item<int64_t>(), 256);
}

TEST(TextDataset, ClearErrors) {
  const std::string dir = dtrain::testing::temp_dir();
  expect_dataset_error([&] { TextDataset::from_path(dir + "/missing.txt", 4); }, "does not exist");
  expect_dataset_error([&] { TextDataset::from_path("", 4); }, "empty data path");
  write_file(dir + "/empty.txt", "");
  expect_dataset_error([&] { TextDataset::from_path(dir + "/empty.txt", 4); }, "is empty");
  write_file(dir + "/short.txt", "abcd");
  expect_dataset_error([&] { TextDataset::from_path(dir + "/short.txt", 4); },
               "fewer than one window of seq_len + 1 = 5 bytes");
  const std::string emptydir = dir + "/nothing";
  ASSERT_EQ(fs::create_directory(emptydir), 0);
  expect_dataset_error([&] { TextDataset::from_path(emptydir, 4); }, "contains no regular files");
  const std::string zeros = dir + "/zeros";
  ASSERT_EQ(fs::create_directory(zeros), 0);
  write_file(zeros + "/x", "");
  expect_dataset_error([&] { TextDataset::from_path(zeros, 4); }, "are all empty");

  expect_dataset_error([] { TextDataset("abc", 0); }, "seq_len must be >= 1");
  expect_dataset_error([] { TextDataset("abcdefgh", 2, -1); }, "stride must be >= 0");
  TextDataset ds(alphabet(10), 4);  // sizes: (10 - 5) / 4 + 1 = 2
  expect_dataset_error([&] { ds.get(2); }, "sample index 2 is out of range [0, 2)");
  expect_dataset_error([&] { ds.batch({0, -1}); }, "sample index -1 is out of range");
}

}  // namespace
