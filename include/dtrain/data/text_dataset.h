#pragma once
// Byte-level text dataset for the GPT demo: the corpus is a byte string, the vocabulary the 256
// byte values, and a sample is a window of seq_len + 1 consecutive bytes split into
// input = window[0, seq_len) and target = window[1, seq_len + 1) (next-byte prediction).
//
// Windows: sample i starts at byte i * stride (stride defaults to seq_len, so the inputs of
// consecutive samples tile the text without overlap and each target's last byte is the next
// sample's first input byte). With L bytes, size() = (L - seq_len - 1) / stride + 1 windows
// (integer division); the trailing bytes that do not fill a window are unused.
//
//   auto text = dtrain::data::TextDataset::from_path(path, /*seq_len=*/128);
//   auto [train, val] = text.split(0.05);        // last 5% of the bytes held out
//   auto [x, y] = train.batch({3, 17, 42});      // int64 [3, 128] each
//
// Copies and splits share the byte storage (read-only), so they are cheap.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::data {

// Real English text present on every Debian machine (~240 KB of licence texts): the demo's
// default corpus when no --data PATH is given.
inline constexpr const char* kDefaultTextCorpus = "/usr/share/common-licenses";

// Reads a file, or every regular file of a directory (sorted by file name, not recursive,
// symlinks followed, each target read once), concatenated. Throws c10::Error when the path does
// not exist, cannot be read, or holds no bytes at all.
std::string read_text_bytes(const std::string& path);

class TextDataset {
 public:
  // stride = 0 means stride = seq_len. Throws c10::Error when seq_len < 1, stride < 0, or the
  // text is shorter than one window (seq_len + 1 bytes).
  TextDataset(std::string bytes, int64_t seq_len, int64_t stride = 0);
  // read_text_bytes(path), then the constructor above (the error names the path).
  static TextDataset from_path(const std::string& path, int64_t seq_len, int64_t stride = 0);

  // {train, val}: val is the last `val_fraction` of the bytes (rounded down, at least one
  // window), train the rest; both keep seq_len and stride. Throws c10::Error when val_fraction
  // is not in (0, 1) or either part would be shorter than one window.
  std::pair<TextDataset, TextDataset> split(double val_fraction = 0.05) const;

  // Number of samples (windows).
  int64_t size() const { return size_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t stride() const { return stride_; }
  int64_t num_bytes() const { return length_; }
  // The dataset's bytes.
  std::string_view bytes() const { return std::string_view(*data_).substr(offset_, length_); }

  // Sample `index` in [0, size()): {input, target}, int64 CPU tensors of shape [seq_len].
  std::pair<at::Tensor, at::Tensor> get(int64_t index) const;
  // The samples `indices` stacked: {inputs, targets}, contiguous int64 CPU tensors [B, seq_len].
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices) const;

 private:
  TextDataset(std::shared_ptr<const std::string> data, int64_t offset, int64_t length,
              int64_t seq_len, int64_t stride);
  void check_index(int64_t index) const;

  std::shared_ptr<const std::string> data_;
  int64_t offset_ = 0;
  int64_t length_ = 0;
  int64_t seq_len_ = 0;
  int64_t stride_ = 0;
  int64_t size_ = 0;
};

}  // namespace dtrain::data
