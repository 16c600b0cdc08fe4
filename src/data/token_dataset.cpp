#include "dtrain/data/token_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/data/token_writer.h"
#include "dtrain/util/fs.h"

namespace dtrain::data {
namespace fs = util::fs;

namespace token_files {  // (named: TokenDataset::Shards holds Mappings)
// A read-only mapping of a whole file (empty files map to nothing).
struct Mapping {
  const unsigned char* data = nullptr;
  size_t bytes = 0;
  explicit Mapping(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    TORCH_CHECK(fd >= 0, "TokenDataset: cannot open '", path, "': ", fs::error_text(errno));
    struct stat st {};
    const bool ok = ::fstat(fd, &st) == 0;
    const int err = errno;
    if (!ok || !S_ISREG(st.st_mode)) ::close(fd);
    TORCH_CHECK(ok, "TokenDataset: cannot stat '", path, "': ", fs::error_text(err));
    TORCH_CHECK(S_ISREG(st.st_mode), "TokenDataset: '", path, "' is not a regular file");
    bytes = static_cast<size_t>(st.st_size);
    if (bytes > 0) {
      void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
      const int merr = errno;
      ::close(fd);
      TORCH_CHECK(p != MAP_FAILED, "TokenDataset: cannot map '", path, "': ", fs::error_text(merr));
      data = static_cast<const unsigned char*>(p);
    } else {
      ::close(fd);
    }
  }
  ~Mapping() {
    if (data) ::munmap(const_cast<unsigned char*>(data), bytes);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

}  // namespace token_files

namespace {

using token_files::Mapping;


// Megatron's token types: code -> bytes per token (0: not an integer type).
int type_bytes(int code) {
  switch (code) {
    case 1: case 2: return 1;  // uint8, int8
    case 3: case 8: return 2;  // int16, uint16
    case 4: return 4;          // int32
    case 5: return 8;          // int64
    default: return 0;         // 6, 7: floating point
  }
}

template <class T>
T read_at(const Mapping& m, size_t at) {
  T v;
  std::memcpy(&v, m.data + at, sizeof v);
  return v;
}

}  // namespace

struct TokenDataset::Shards {
  struct Shard {
    std::string file;
    std::shared_ptr<Mapping> map;
    int code = 8;  // Megatron's type code (a flat nanoGPT file: uint16)
    int64_t tokens = 0, offset = 0;  // its tokens, and where they start in the stream
  };
  std::vector<Shard> shards;
  std::vector<std::string> files;
  int64_t tokens = 0, documents = 0;
};

namespace {

using Shard = TokenDataset::Shards::Shard;

// prefix.idx against prefix.bin: Megatron's layout (magic, version 1, type, counts, lengths,
// offsets, document starts), every offset where the lengths put it, the .bin's size their sum.
Shard open_indexed(const std::string& bin, const std::string& idx, int64_t& documents) {
  Shard s;
  s.file = bin;
  const Mapping index(idx);
  const size_t header = 9 + 8 + 1 + 8 + 8;
  auto bad = [&](const std::string& why) {
    TORCH_CHECK(false, "TokenDataset: '", idx, "' is not the Megatron index of '", bin, "': ", why);
  };
  if (index.bytes < header || std::memcmp(index.data, kMegatronIndexMagic, 9) != 0) bad("it does not start with MMIDIDX");
  if (read_at<uint64_t>(index, 9) != 1) bad("version " + std::to_string(read_at<uint64_t>(index, 9)) + ", expected 1");
  s.code = index.data[17];
  const int bytes = type_bytes(s.code);
  if (bytes == 0) bad("token type " + std::to_string(s.code) + " is not an integer type");
  const uint64_t sequences = read_at<uint64_t>(index, 18), docs = read_at<uint64_t>(index, 26);
  if (index.bytes != header + 12 * sequences + 8 * docs) {
    bad("its size (" + std::to_string(index.bytes) + " bytes) is not that of " + std::to_string(sequences) +
        " sequences and " + std::to_string(docs) + " document starts (truncated?)");
  }
  s.map = std::make_shared<Mapping>(bin);
  const Mapping& data = *s.map;
  uint64_t expected = 0;
  for (uint64_t i = 0; i < sequences; ++i) {
    const int32_t length = read_at<int32_t>(index, header + 4 * i);
    const int64_t pointer = read_at<int64_t>(index, header + 4 * sequences + 8 * i);
    if (length < 0 || static_cast<uint64_t>(pointer) != expected) {
      bad("sequence " + std::to_string(i) + " has length " + std::to_string(length) + " at byte " + std::to_string(pointer) +
          " where the lengths before it end at byte " + std::to_string(expected));
    }
    expected += static_cast<uint64_t>(length) * static_cast<uint64_t>(bytes);
  }
  if (expected != data.bytes) {
    bad("its sequences take " + std::to_string(expected) + " bytes, the .bin has " + std::to_string(data.bytes));
  }
  const size_t doc_at = header + 12 * sequences;
  if (docs < 1 || read_at<int64_t>(index, doc_at) != 0 || read_at<int64_t>(index, doc_at + 8 * (docs - 1)) != static_cast<int64_t>(sequences)) {
    bad("its document starts do not run from sequence 0 to " + std::to_string(sequences));
  }
  documents += static_cast<int64_t>(docs) - 1;
  s.tokens = static_cast<int64_t>(expected / static_cast<uint64_t>(bytes));
  return s;
}

Shard open_flat(const std::string& bin, int64_t& documents) {
  Shard s;
  s.file = bin;
  s.map = std::make_shared<Mapping>(bin);
  TORCH_CHECK(s.map->bytes % 2 == 0, "TokenDataset: '", bin, "' has ", s.map->bytes,
              " bytes, not a whole number of uint16 tokens (truncated? a Megatron .bin needs its .idx beside it)");
  s.tokens = static_cast<int64_t>(s.map->bytes / 2);
  documents += 1;
  return s;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

TokenDataset TokenDataset::open(const std::string& path, int64_t seq_len, int64_t vocab_size) {
  TORCH_CHECK(seq_len >= 1, "TokenDataset: seq_len must be at least 1, got ", seq_len);
  std::vector<std::string> bins;
  if (fs::is_directory(path)) {
    for (const auto& name : fs::list_directory(path)) {
      if (ends_with(name, ".bin")) bins.push_back(fs::join(path, name));
    }
    std::sort(bins.begin(), bins.end());
    TORCH_CHECK(!bins.empty(), "TokenDataset: '", path, "' holds no .bin token files");
  } else {
    TORCH_CHECK(fs::exists(path), "TokenDataset: '", path, "' does not exist; pass a .bin token file or a directory of them");
    bins.push_back(path);
  }
  auto shards = std::make_shared<Shards>();
  for (const auto& bin : bins) {
    const std::string idx = (ends_with(bin, ".bin") ? bin.substr(0, bin.size() - 4) : bin) + ".idx";
    Shard s = fs::exists(idx) ? open_indexed(bin, idx, shards->documents) : open_flat(bin, shards->documents);
    s.offset = shards->tokens;
    shards->tokens += s.tokens;
    shards->files.push_back(bin);
    shards->shards.push_back(std::move(s));
  }
  TORCH_CHECK(shards->tokens >= seq_len + 1, "TokenDataset: '", path, "' holds ", shards->tokens,
              " tokens, fewer than one window of seq_len + 1 = ", seq_len + 1);
  return TokenDataset(shards, 0, shards->tokens, seq_len, vocab_size);
}

TokenDataset::TokenDataset(std::shared_ptr<const Shards> shards, int64_t first, int64_t length, int64_t seq_len, int64_t vocab)
    : shards_(std::move(shards)), first_(first), length_(length), seq_len_(seq_len), vocab_(vocab),
      size_(length >= seq_len + 1 ? (length - seq_len - 1) / seq_len + 1 : 0) {}

int64_t TokenDataset::num_documents() const { return shards_->documents; }
const std::vector<std::string>& TokenDataset::files() const { return shards_->files; }

std::pair<TokenDataset, TokenDataset> TokenDataset::split(double val_fraction) const {
  TORCH_CHECK(val_fraction > 0 && val_fraction < 1, "TokenDataset::split: val_fraction must be in (0, 1), got ", val_fraction);
  const int64_t held = std::max<int64_t>(1, static_cast<int64_t>(val_fraction * static_cast<double>(size_)));
  TORCH_CHECK(held < size_, "TokenDataset::split: ", size_, " windows cannot give ", held, " to validation and keep some");
  const int64_t cut = (size_ - held) * seq_len_;  // (the validation windows' tokens start here)
  return {TokenDataset(shards_, first_, cut + 1, seq_len_, vocab_),
          TokenDataset(shards_, first_ + cut, length_ - cut, seq_len_, vocab_)};
}

void TokenDataset::read(int64_t token, int64_t count, int64_t* out) const {
  const auto& shards = shards_->shards;
  while (count > 0) {
    auto it = std::upper_bound(shards.begin(), shards.end(), token, [](int64_t t, const Shard& s) { return t < s.offset; });
    const Shard& s = *(it - 1);
    const int64_t at = token - s.offset, n = std::min(count, s.tokens - at);
    const unsigned char* p = s.map->data + at * type_bytes(s.code);
    for (int64_t i = 0; i < n; ++i) {
      int64_t v = 0;
      switch (s.code) {
        case 1: v = p[i]; break;
        case 2: v = static_cast<int8_t>(p[i]); break;
        case 3: { int16_t x; std::memcpy(&x, p + 2 * i, 2); v = x; break; }
        case 4: { int32_t x; std::memcpy(&x, p + 4 * i, 4); v = x; break; }
        case 5: std::memcpy(&v, p + 8 * i, 8); break;
        default: { uint16_t x; std::memcpy(&x, p + 2 * i, 2); v = x; break; }
      }
      TORCH_CHECK(v >= 0 && (vocab_ <= 0 || v < vocab_), "TokenDataset: '", s.file, "' has token ", v, " at token ", at + i,
                  (v < 0 ? std::string(": a token id is never negative") :
                           ", outside the model's vocabulary of " + std::to_string(vocab_) + " (--vocab-size)"));
      out[i] = v;
    }
    out += n, token += n, count -= n;
  }
}

std::pair<at::Tensor, at::Tensor> TokenDataset::get(int64_t index) const { return batch({index}); }

std::pair<at::Tensor, at::Tensor> TokenDataset::batch(const std::vector<int64_t>& indices) const {
  const int64_t b = static_cast<int64_t>(indices.size());
  auto window = at::empty({b, seq_len_ + 1}, at::kLong);
  int64_t* w = window.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    const int64_t i = indices[static_cast<size_t>(r)];
    TORCH_CHECK(i >= 0 && i < size_, "TokenDataset: sample ", i, " is out of range [0, ", size_, ")");
    read(first_ + i * seq_len_, seq_len_ + 1, w + r * (seq_len_ + 1));
  }
  return {window.narrow(1, 0, seq_len_).contiguous(), window.narrow(1, 1, seq_len_).contiguous()};
}

}  // namespace dtrain::data
