#include "dtrain/data/text_dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/util/fs.h"

namespace dtrain::data {
namespace fs = util::fs;

namespace {

// At most half the machine's memory of text: the dataset holds it all.
uint64_t max_text_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2 : (uint64_t{8} << 30);
}

// Reads a regular file whole: its size is fixed first (a FIFO, device or socket is refused, never
// read: /dev/zero would never end, a FIFO would block), bounded by `budget` bytes, and a file that
// changes size while being read is an error.
std::string read_file(const std::string& p, uint64_t& budget) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // (O_NONBLOCK: opening a FIFO does not wait)
  TORCH_CHECK(fd >= 0, "TextDataset: cannot open '", p, "' for reading: ", fs::error_text(errno),
              "; check that the file exists and is readable");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  TORCH_CHECK(::fstat(fd, &st) == 0, "TextDataset: cannot stat '", p, "': ", fs::error_text(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), "TextDataset: '", p, "' is not a regular file (",
              S_ISFIFO(st.st_mode) ? "a named pipe" : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
              : S_ISSOCK(st.st_mode) ? "a socket" : "not a file", "); pass a text file or a directory of text files");
  const auto size = static_cast<uint64_t>(st.st_size);
  TORCH_CHECK(size <= budget, "TextDataset: '", p, "' is ", size, " bytes, more than the ", budget,
              " bytes of text left to read (half the machine's memory in all); pass a smaller corpus");
  budget -= size;
  std::string out(size, '\0');
  uint64_t at = 0;
  while (at < size) {
    const ssize_t n = ::pread(fd, out.data() + at, size - at, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, "TextDataset: error while reading '", p, "': ", fs::error_text(errno));
    TORCH_CHECK(n > 0, "TextDataset: '", p, "' ended after ", at, " of its ", size,
                " bytes (it changed while being read)");
    at += static_cast<uint64_t>(n);
  }
  return out;
}

}  // namespace

std::string read_text_bytes(const std::string& path) {
  const std::string& p = path;
  TORCH_CHECK(!path.empty(), "TextDataset: empty data path; pass a text file or a directory of "
              "text files (e.g. ", kDefaultTextCorpus, ")");
  TORCH_CHECK(fs::exists(p), "TextDataset: data path '", path,
              "' does not exist; pass a text file or a directory of text files (e.g. ",
              kDefaultTextCorpus, ")");
  if (fs::is_directory(p)) {
    std::vector<std::string> files;
    std::set<std::string> seen;  // canonical targets, so a symlink to a file already read is skipped
    int err = 0;
    for (const auto& name : fs::list_directory(p, &err)) {  // sorted by name
      const std::string f = fs::join(p, name);
      if (fs::is_regular_file(f)) files.push_back(f);  // follows symlinks
    }
    TORCH_CHECK(err == 0, "TextDataset: cannot list directory '", path, "': ", fs::error_text(err));
    std::string out;
    uint64_t budget = max_text_bytes();
    for (const auto& f : files) {
      auto canon = fs::canonical(f);
      if (canon && !seen.insert(*canon).second) continue;
      out += read_file(f, budget);
    }
    TORCH_CHECK(!files.empty(), "TextDataset: directory '", path,
                "' contains no regular files; pass a directory holding text files");
    TORCH_CHECK(!out.empty(), "TextDataset: the files in directory '", path,
                "' are all empty; pass a non-empty text corpus");
    return out;
  }
  uint64_t budget = max_text_bytes();
  std::string out = read_file(p, budget);
  TORCH_CHECK(!out.empty(), "TextDataset: file '", path,
              "' is empty; pass a non-empty text corpus");
  return out;
}

TextDataset::TextDataset(std::string bytes, int64_t seq_len, int64_t stride)
    : TextDataset(std::make_shared<const std::string>(std::move(bytes)), 0, -1, seq_len, stride) {}

TextDataset::TextDataset(std::shared_ptr<const std::string> data, int64_t offset, int64_t length,
                         int64_t seq_len, int64_t stride)
    : data_(std::move(data)),
      offset_(offset),
      length_(length < 0 ? static_cast<int64_t>(data_->size()) : length),
      seq_len_(seq_len),
      stride_(stride == 0 ? seq_len : stride) {
  TORCH_CHECK(seq_len >= 1, "TextDataset: seq_len must be >= 1, got ", seq_len);
  TORCH_CHECK(stride >= 0, "TextDataset: stride must be >= 0 (0 means seq_len), got ", stride);
  TORCH_CHECK(length_ >= seq_len + 1, "TextDataset: the text has ", length_,
              " bytes, fewer than one window of seq_len + 1 = ", seq_len + 1,
              " bytes; use a longer text or a smaller seq_len");
  size_ = (length_ - seq_len_ - 1) / stride_ + 1;
}

TextDataset TextDataset::from_path(const std::string& path, int64_t seq_len, int64_t stride) {
  std::string bytes = read_text_bytes(path);
  TORCH_CHECK(static_cast<int64_t>(bytes.size()) >= seq_len + 1, "TextDataset: '", path,
              "' has ", bytes.size(), " bytes, fewer than one window of seq_len + 1 = ",
              seq_len + 1, " bytes; use a longer text or a smaller seq_len");
  return TextDataset(std::move(bytes), seq_len, stride);
}

std::pair<TextDataset, TextDataset> TextDataset::split(double val_fraction) const {
  TORCH_CHECK(val_fraction > 0.0 && val_fraction < 1.0,
              "TextDataset::split: val_fraction must be in (0, 1), got ", val_fraction);
  const int64_t window = seq_len_ + 1;
  int64_t val_len = static_cast<int64_t>(static_cast<double>(length_) * val_fraction);
  val_len = std::max(val_len, window);
  const int64_t train_len = length_ - val_len;
  TORCH_CHECK(train_len >= window, "TextDataset::split: ", length_,
              " bytes are too few to hold out ", val_len, " bytes and keep a training window of ",
              window, " bytes; use a longer text, a smaller seq_len or a smaller val_fraction");
  return {TextDataset(data_, offset_, train_len, seq_len_, stride_),
          TextDataset(data_, offset_ + train_len, val_len, seq_len_, stride_)};
}

void TextDataset::check_index(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size_, "TextDataset: sample index ", index,
              " is out of range [0, ", size_, "); the dataset has size() = ", size_, " windows");
}

std::pair<at::Tensor, at::Tensor> TextDataset::get(int64_t index) const {
  auto [x, y] = batch({index});
  return {x[0], y[0]};
}

std::pair<at::Tensor, at::Tensor> TextDataset::batch(const std::vector<int64_t>& indices) const {
  const auto b = static_cast<int64_t>(indices.size());
  const int64_t t = seq_len_;
  at::Tensor inputs = at::empty({b, t}, at::TensorOptions().dtype(at::kLong));
  at::Tensor targets = at::empty({b, t}, at::TensorOptions().dtype(at::kLong));
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* tg = targets.data_ptr<int64_t>();
  const auto* base = reinterpret_cast<const unsigned char*>(data_->data()) + offset_;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t index = indices[static_cast<size_t>(r)];
    check_index(index);
    const unsigned char* w = base + index * stride_;
    int64_t* in_row = in + r * t;
    int64_t* tg_row = tg + r * t;
    for (int64_t j = 0; j < t; ++j) {
      in_row[j] = w[j];
      tg_row[j] = w[j + 1];
    }
  }
  return {inputs, targets};
}

}  // namespace dtrain::data
