#pragma once
// Token datasets over memory-mapped files, never read whole: nanoGPT's flat .bin files (uint16
// tokens, one after another) and Megatron's indexed pairs (prefix.bin with prefix.idx beside it:
// the "MMIDIDX" index of its documents' lengths and offsets and the token type), one file or a
// directory of shards (sorted by name). The shards' tokens are one stream (documents
// concatenated, as nanoGPT and Megatron's GPT dataset train on them); sample i is the window of
// seq_len + 1 tokens starting at token i * seq_len: input = window[0, seq_len), target =
// window[1, seq_len + 1) (a window may span two shards).
//
//   auto tokens = dtrain::data::TokenDataset::open("data/train.bin", /*seq_len=*/256, /*vocab=*/8192);
//   auto [train, val] = tokens.split(0.05);        // the last 5% of the windows held out
//   auto [x, y] = train.batch({3, 17, 42});        // int64 [3, 256] each
//
// Only the pages of the windows a batch reads are brought in; copies and splits share the
// mappings. Errors name the file: a flat .bin whose size is not a whole number of uint16 tokens, an
// .idx that is not Megatron's or does not match its .bin (lengths, offsets, size), a token type
// that is not an integer, a token at or above the model's vocabulary (found in the batch that
// reads it: the file is not scanned whole), a stream shorter than one window.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/data/token_writer.h"  // (write_indexed_tokens: the format written)

namespace dtrain::data {

class TokenDataset {
 public:
  // path: a .bin file (Megatron's when path minus ".bin" plus ".idx" exists, else nanoGPT's), or a
  // directory of them. vocab_size > 0: every token read must be below it.
  static TokenDataset open(const std::string& path, int64_t seq_len, int64_t vocab_size = 0);

  int64_t size() const { return size_; }  // windows
  int64_t seq_len() const { return seq_len_; }
  int64_t num_tokens() const { return length_; }
  int64_t num_documents() const;  // Megatron shards' documents; a flat file counts as one
  const std::vector<std::string>& files() const;

  // {train, val}: val the last `val_fraction` of the windows (at least one), train the rest.
  std::pair<TokenDataset, TokenDataset> split(double val_fraction) const;
  std::pair<at::Tensor, at::Tensor> get(int64_t index) const;
  // The samples `indices` stacked: {inputs, targets}, int64 CPU tensors [B, seq_len].
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<int64_t>& indices) const;

  struct Shards;  // the mapped files (src/data/token_dataset.cpp)

 private:
  TokenDataset(std::shared_ptr<const Shards> shards, int64_t first, int64_t length, int64_t seq_len, int64_t vocab);
  void read(int64_t token, int64_t count, int64_t* out) const;  // tokens [token, token + count) of the stream

  std::shared_ptr<const Shards> shards_;
  int64_t first_ = 0, length_ = 0;  // this dataset's tokens of the stream
  int64_t seq_len_ = 0, vocab_ = 0, size_ = 0;
};

}  // namespace dtrain::data
