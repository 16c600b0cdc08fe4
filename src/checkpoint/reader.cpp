// Reader: a committed checkpoint, validated before any byte is used. See docs/checkpoint.md.
#include <algorithm>
#include <regex>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/checkpoint/manifest.h"
#include "dtrain/checkpoint/sha256.h"
#include "dtrain/checkpoint/store.h"
#include "dtrain/util/fs.h"
#include "dtypes.h"
#include "io.h"

namespace dtrain::checkpoint {

namespace fs = util::fs;

namespace {

constexpr uint64_t kMaxManifestBytes = uint64_t(1) << 30;

// FormatError (from the libtorch-free parsers) as c10::Error with the same text.
template <class F>
auto rethrow_format_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const FormatError& e) {
    TORCH_CHECK(false, e.what());
  }
}

// A rank file's state in a Reader: Unchecked (only its size is known to match) -> Verified (hash,
// header and the manifest's pieces in it checked; readable).
enum class FileCheck {
  Unchecked,  // size checked at open; hash and header not yet read
  Verified,   // SHA-256 equals the manifest's, header valid and consistent with the manifest
};

struct FileState {
  const ManifestFile* meta = nullptr;
  std::string path;
  FileCheck check = FileCheck::Unchecked;
  detail::File file;
  SafetensorsHeader header;
  std::map<std::string, const SafetensorsEntry*> entries;  // by name
};

}  // namespace

struct Reader::State {
  std::string dir;
  Manifest manifest;
  std::vector<FileState> files;
  std::map<std::string, size_t> file_index;  // by name
  Reader::Fill memory;  // set: a checkpoint in memory (Reader::in_memory), no files

  std::string where() const { return "checkpoint " + dir; }

  const ManifestTensor& tensor(const std::string& key) const {
    auto it = manifest.tensors.find(key);
    TORCH_CHECK(it != manifest.tensors.end(), where(), ": no tensor \"", key, "\" in this checkpoint (",
                manifest.tensors.size(), " keys; see Reader::keys())");
    return it->second;
  }

  // Hash, header and cross-check of one file, once.
  FileState& verified(const std::string& name) {
    FileState& fst = files.at(file_index.at(name));
    if (fst.check == FileCheck::Verified) return fst;
    fst.file = detail::File::open_read(fst.path);
    const uint64_t size = fst.file.size();
    TORCH_CHECK(size == fst.meta->size, "checkpoint ", fst.path, ": ", size, " bytes, but the manifest says ",
                fst.meta->size, " (truncated or replaced?)");
    Sha256 sha;
    std::vector<char> buf(std::min<uint64_t>(size, 8 << 20));
    for (uint64_t at = 0; at < size; at += buf.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size - at));
      fst.file.pread_all(buf.data(), n, at);
      sha.update(buf.data(), n);
    }
    const std::string digest = sha.hex_digest();
    TORCH_CHECK(digest == fst.meta->sha256, "checkpoint ", fst.path, ": SHA-256 ", digest,
                " does not match the manifest's sha256 ", fst.meta->sha256, " (the file is corrupted or was modified)");
    unsigned char first8[8] = {};
    fst.file.pread_all(first8, std::min<uint64_t>(8, size), 0);
    const uint64_t n = rethrow_format_errors([&] { return parse_safetensors_header_length(first8, size, fst.path); });
    std::string json(n, '\0');
    fst.file.pread_all(json.data(), n, 8);
    fst.header = rethrow_format_errors([&] { return parse_safetensors_header(json, size, fst.path); });
    for (const auto& e : fst.header.entries) fst.entries[e.name] = &e;
    // Every piece the manifest places in this file is there, as the manifest describes it, and
    // the file holds nothing else.
    size_t used = 0;
    for (const auto& [key, t] : manifest.tensors) {
      for (const auto& p : t.pieces) {
        if (p.file != name) continue;
        ++used;
        auto it = fst.entries.find(p.tensor);
        TORCH_CHECK(it != fst.entries.end(), "checkpoint ", fst.path, ": tensor \"", p.tensor,
                    "\" (piece of \"", key, "\" in the manifest) is not in the file's header");
        const SafetensorsEntry& e = *it->second;
        TORCH_CHECK(e.dtype == t.dtype, "checkpoint ", fst.path, ": tensor \"", p.tensor, "\": dtype ",
                    dtype_name(e.dtype), " but the manifest says ", dtype_name(t.dtype), " for \"", key, "\"");
        const bool whole_shape = p.begin == 0 && p.numel == t.numel() && e.shape == t.shape;
        TORCH_CHECK(whole_shape || e.shape == std::vector<int64_t>{p.numel}, "checkpoint ", fst.path, ": tensor \"",
                    p.tensor, "\": shape ", shape_string(e.shape), " but the manifest's piece of \"", key,
                    "\" has ", p.numel, " elements (expected [", p.numel, "]",
                    p.numel == t.numel() ? " or " + shape_string(t.shape) : std::string(), ")");
      }
    }
    TORCH_CHECK(used == fst.header.entries.size(), "checkpoint ", fst.path, ": the header lists ",
                fst.header.entries.size(), " tensors but the manifest places ", used,
                " pieces in this file (a tensor the manifest does not know?)");
    fst.check = FileCheck::Verified;
    return fst;
  }

  // Elements [begin, end) of `key` into `dst` (contiguous, of the key's dtype).
  void fill(const std::string& key, int64_t begin, int64_t end, char* dst) {
    const ManifestTensor& t = tensor(key);
    TORCH_CHECK(0 <= begin && begin <= end && end <= t.numel(), where(), ": read of \"", key, "\" elements [", begin,
                ", ", end, ") outside its ", t.numel(), " elements");
    const int64_t item = dtype_size(t.dtype);
    if (memory) {
      memory(key, begin, end, dst);
      return;
    }
    auto it = std::upper_bound(t.pieces.begin(), t.pieces.end(), begin,
                               [](int64_t b, const ManifestPiece& p) { return b < p.begin; });
    if (it != t.pieces.begin()) --it;
    for (; it != t.pieces.end() && it->begin < end; ++it) {
      const int64_t lo = std::max(begin, it->begin);
      const int64_t hi = std::min(end, it->begin + it->numel);
      if (lo >= hi) continue;
      FileState& f = verified(it->file);
      const SafetensorsEntry& e = *f.entries.at(it->tensor);
      f.file.pread_all(dst + (lo - begin) * item, static_cast<size_t>((hi - lo) * item),
                       f.header.buffer_offset + e.begin + static_cast<uint64_t>((lo - it->begin) * item));
    }
    if (t.dtype == Dtype::BOOL) {
      const auto* b = reinterpret_cast<const unsigned char*>(dst);
      for (int64_t i = 0; i < end - begin; ++i) {
        TORCH_CHECK(b[i] <= 1, where(), ": \"", key, "\" element ", begin + i, " is a BOOL with byte value ",
                    int(b[i]), " (only 0 and 1 are valid)");
      }
    }
  }
};

Reader::Reader(std::unique_ptr<State> state) : state_(std::move(state)) {}

void Reader::verify_files(int part, int parts) const {
  TORCH_CHECK(parts >= 1 && part >= 0 && part < parts, "Reader::verify_files: part ", part, " of ", parts);
  const auto& files = state_->manifest.files;
  for (size_t i = static_cast<size_t>(part); i < files.size(); i += static_cast<size_t>(parts)) {
    state_->verified(files[i].name);
  }
}
Reader::Reader(Reader&&) noexcept = default;
Reader& Reader::operator=(Reader&&) noexcept = default;
Reader::~Reader() = default;

Reader Reader::open(const std::string& path) {
  std::string dir = path;
  if (!fs::exists(fs::join(path, kManifestFileName))) {
    TORCH_CHECK(fs::exists(fs::join(path, "latest")), "checkpoint ", path,
                ": neither a checkpoint directory (no ", kManifestFileName, ") nor a checkpoint root (no latest)");
    dir = *latest(path);
  }
  auto s = std::make_unique<State>();
  s->dir = dir;
  const std::string manifest_path = fs::join(dir, kManifestFileName);
  const std::string text = detail::read_file(manifest_path, kMaxManifestBytes);
  s->manifest = rethrow_format_errors([&] { return parse_manifest(text, "checkpoint " + manifest_path); });
  static const std::regex step_re("step-([0-9]{1,18})");
  std::smatch m;
  const std::string base = fs::filename(dir);
  if (std::regex_match(base, m, step_re)) {
    TORCH_CHECK(std::stoll(m[1].str()) == s->manifest.step, "checkpoint ", manifest_path, ": step ",
                s->manifest.step, " but the directory is named ", base, " (a manifest from another checkpoint?)");
  }
  for (const auto& f : s->manifest.files) {
    FileState fst;
    fst.meta = &f;
    fst.path = fs::join(dir, f.name);
    const auto size = fs::file_size(fst.path);
    TORCH_CHECK(size, "checkpoint ", fst.path, ": listed in the manifest but cannot be read: ",
                fs::exists(fst.path) ? "not a regular file" : "No such file or directory", " (missing file?)");
    TORCH_CHECK(*size == f.size, "checkpoint ", fst.path, ": ", *size, " bytes, but the manifest says ", f.size,
                " (truncated or replaced?)");
    s->file_index[f.name] = s->files.size();
    s->files.push_back(std::move(fst));
  }
  return Reader(std::move(s));
}

Reader Reader::in_memory(int64_t step, int world_size, std::map<std::string, std::string> metadata,
                         const std::map<std::string, TensorInfo>& tensors, Fill fill) {
  TORCH_CHECK(fill, "Reader::in_memory: no fill function");
  auto s = std::make_unique<State>();
  s->dir = "(in memory)";
  s->memory = std::move(fill);
  s->manifest.step = step;
  s->manifest.world_size = world_size;
  s->manifest.metadata = std::move(metadata);
  for (const auto& [key, info] : tensors) {
    ManifestTensor& t = s->manifest.tensors[key];
    t.shape = info.shape;
    t.dtype = detail::require_dtype(info.dtype, "Reader::in_memory: \"" + key + "\"");
  }
  return Reader(std::move(s));
}

const std::string& Reader::dir() const { return state_->dir; }
int64_t Reader::step() const { return state_->manifest.step; }
const std::map<std::string, std::string>& Reader::metadata() const { return state_->manifest.metadata; }
bool Reader::has(const std::string& key) const { return state_->manifest.tensors.count(key) > 0; }
int Reader::saved_world_size() const { return static_cast<int>(state_->manifest.world_size); }

std::vector<std::string> Reader::keys() const {
  std::vector<std::string> out;
  for (const auto& kv : state_->manifest.tensors) out.push_back(kv.first);
  return out;
}

std::vector<std::string> Reader::keys_with_prefix(const std::string& prefix) const {
  std::vector<std::string> out;
  const auto& tensors = state_->manifest.tensors;
  for (auto it = tensors.lower_bound(prefix); it != tensors.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
    out.push_back(it->first);
  }
  return out;
}

TensorInfo Reader::info(const std::string& key) const {
  const ManifestTensor& t = state_->tensor(key);
  return {t.shape, detail::to_scalar_type(t.dtype)};
}

at::Tensor Reader::read(const std::string& key, int64_t begin, int64_t end) const {
  const ManifestTensor& t = state_->tensor(key);
  TORCH_CHECK(0 <= begin && begin <= end && end <= t.numel(), state_->where(), ": read of \"", key, "\" elements [",
              begin, ", ", end, ") outside its ", t.numel(), " elements");
  at::Tensor out = at::empty({end - begin}, at::TensorOptions().dtype(detail::to_scalar_type(t.dtype)));
  state_->fill(key, begin, end, static_cast<char*>(out.data_ptr()));
  return out;
}

at::Tensor Reader::read(const std::string& key) const {
  const ManifestTensor& t = state_->tensor(key);
  return read(key, 0, t.numel()).reshape(t.shape);
}

void Reader::read_into(const std::string& key, at::Tensor& out) const {
  const ManifestTensor& t = state_->tensor(key);
  const at::ScalarType dtype = detail::to_scalar_type(t.dtype);
  TORCH_CHECK(out.defined(), state_->where(), ": read_into(\"", key, "\"): the output tensor is undefined");
  TORCH_CHECK(out.sizes().vec() == t.shape && out.scalar_type() == dtype, state_->where(), ": read_into(\"", key,
              "\"): the checkpoint holds shape ", shape_string(t.shape), " ", c10::toString(dtype),
              " but the output tensor is ", shape_string(out.sizes().vec()), " ", c10::toString(out.scalar_type()),
              " (a different model or configuration?)");
  if (out.device().is_cpu() && out.is_contiguous()) {
    state_->fill(key, 0, t.numel(), static_cast<char*>(out.data_ptr()));
    return;
  }
  const at::Tensor tmp = read(key);
  at::NoGradGuard no_grad;
  out.copy_(tmp);
}

}  // namespace dtrain::checkpoint
