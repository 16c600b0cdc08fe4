#include "dtrain/checkpoint/streaming_writer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/checkpoint/sha256.h"
#include "dtrain/util/fs.h"
#include "dtypes.h"
#include "io.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian: big-endian hosts are not supported");

namespace dtrain::checkpoint {

// One pass over the file, in order: Open (header written, tensors expected in header order) ->
// Finished (renamed into place) or Failed (an error happened; the temporary file is removed).
enum class WriterPhase {
  Open,      // accepting tensor data
  Finished,  // finish() succeeded: the file is at its final path
  Failed,    // a write or the finish failed: every further call errors
};

struct StreamingWriter::State {
  std::string path;
  std::string tmp;
  StreamingWriterOptions options;
  SafetensorsHeader header;
  std::vector<at::ScalarType> dtypes;
  detail::File file;
  Sha256 sha;
  uint64_t bytes = 0;
  size_t index = 0;     // the tensor being written
  int64_t written = 0;  // its elements written so far
  WriterPhase phase = WriterPhase::Open;
  std::string empty;

  std::string where() const { return "checkpoint " + path; }
  void check_open() const {
    TORCH_CHECK(phase == WriterPhase::Open, where(), ": the writer is ",
                phase == WriterPhase::Finished ? "finished" : "broken by an earlier error", "; no more writes");
  }
  void put(const void* data, size_t n) {
    file.write_all(data, n);
    sha.update(data, n);
    bytes += n;
  }
  void skip_empty() {
    while (index < header.entries.size() && header.entries[index].numel() == 0) ++index;
  }
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (...) {
      phase = WriterPhase::Failed;
      throw;
    }
  }
};

StreamingWriter::StreamingWriter(std::string path, std::vector<TensorSpec> tensors,
                                 std::map<std::string, std::string> metadata, const StreamingWriterOptions& options)
    : state_(std::make_unique<State>()) {
  auto& s = *state_;
  s.path = std::move(path);
  s.options = options;
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& t : tensors) {
    specs.push_back({t.name, detail::require_dtype(t.dtype, s.where() + ": tensor \"" + t.name + "\""), t.shape});
    s.dtypes.push_back(t.dtype);
  }
  std::string prefix;
  try {
    s.header = lay_out_safetensors(specs, metadata, &prefix, s.path);
  } catch (const FormatError& e) {
    TORCH_CHECK(false, e.what());
  }
  s.tmp = s.path + ".tmp-" + detail::nonce();
  s.file = detail::File::create(s.tmp);
  s.guarded([&] { s.put(prefix.data(), prefix.size()); });
  s.skip_empty();
}

StreamingWriter::StreamingWriter(StreamingWriter&&) noexcept = default;
StreamingWriter& StreamingWriter::operator=(StreamingWriter&&) noexcept = default;

StreamingWriter::~StreamingWriter() {
  if (state_ && state_->phase != WriterPhase::Finished && !state_->tmp.empty()) {
    state_->file = detail::File();
    util::fs::remove(state_->tmp);
  }
}

const std::string& StreamingWriter::next_name() const {
  const auto& s = *state_;
  return s.index < s.header.entries.size() ? s.header.entries[s.index].name : s.empty;
}

void StreamingWriter::write(const std::string& name, const at::Tensor& data) {
  auto& s = *state_;
  s.check_open();
  const SafetensorsEntry* e = s.header.find(name);
  TORCH_CHECK(e, s.where(), ": write(\"", name, "\"): no such tensor in the header");
  if (e->numel() == 0) {
    TORCH_CHECK(data.defined() && data.numel() == 0, s.where(), ": tensor \"", name, "\" has no elements but ",
                data.defined() ? data.numel() : 0, " were passed");
    return;  // nothing to write; its place in the order does not matter
  }
  TORCH_CHECK(name == next_name(), s.where(), ": write(\"", name, "\") out of order: the header's next tensor is \"",
              next_name(), "\" (tensors must arrive in header order)");
  TORCH_CHECK(s.written == 0, s.where(), ": write(\"", name, "\"): ", s.written,
              " of its elements were already appended; use append() for the rest");
  TORCH_CHECK(data.defined() && data.numel() == e->numel(), s.where(), ": tensor \"", name, "\" has ",
              e->numel(), " elements (shape ", shape_string(e->shape), ") but ",
              data.defined() ? data.numel() : 0, " were passed");
  append(data);
}

void StreamingWriter::append(const at::Tensor& chunk) {
  auto& s = *state_;
  s.check_open();
  TORCH_CHECK(chunk.defined(), s.where(), ": append() of an undefined tensor");
  if (chunk.numel() == 0) return;
  TORCH_CHECK(s.index < s.header.entries.size(), s.where(), ": append() of ", chunk.numel(),
              " elements after every tensor of the header was written");
  const auto& e = s.header.entries[s.index];
  TORCH_CHECK(chunk.scalar_type() == s.dtypes[s.index], s.where(), ": tensor \"", e.name, "\" is declared ",
              c10::toString(s.dtypes[s.index]), " but got ", c10::toString(chunk.scalar_type()));
  TORCH_CHECK(chunk.numel() <= e.numel() - s.written, s.where(), ": tensor \"", e.name, "\": a chunk of ",
              chunk.numel(), " elements runs past its end (", e.numel() - s.written, " of ", e.numel(), " left)");
  s.guarded([&] {
    const at::Tensor c = chunk.to(at::kCPU).contiguous();
    s.put(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
    s.written += c.numel();
    if (s.written == e.numel()) {
      s.written = 0;
      ++s.index;
      s.skip_empty();
    }
  });
}

WrittenFile StreamingWriter::finish() {
  auto& s = *state_;
  s.check_open();
  TORCH_CHECK(s.index == s.header.entries.size(), s.where(), ": finish() before tensor \"", next_name(),
              "\" was written (", s.written, " of its ", s.header.entries[std::min(s.index, s.header.entries.size() - 1)].numel(),
              " elements)");
  s.guarded([&] {
    TORCH_CHECK(s.bytes == s.header.buffer_offset + s.header.buffer_bytes, s.where(), ": wrote ", s.bytes,
                " bytes, the header lays out ", s.header.buffer_offset + s.header.buffer_bytes);
    if (s.options.fsync()) s.file.fsync();
    s.file.close();
    TORCH_CHECK(std::rename(s.tmp.c_str(), s.path.c_str()) == 0, s.where(), ": cannot rename ", s.tmp,
                " to it: ", std::strerror(errno));
    if (s.options.fsync()) detail::fsync_dir(detail::parent_dir(s.path));
  });
  s.phase = WriterPhase::Finished;
  return {s.path, s.bytes, s.sha.hex_digest()};
}

std::string export_module_weights(const torch::nn::Module& module, const std::string& path) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::unordered_set<const void*> seen;  // a tied parameter is one tensor under several names
  for (const auto& p : module.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) tensors.emplace_back(p.key(), p.value());
  }
  for (const auto& b : module.named_buffers()) tensors.emplace_back(b.key(), b.value());
  return export_named_weights(tensors, path);
}

std::string export_named_weights(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& path) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.sizes().vec(), t.scalar_type()});
  StreamingWriter writer(path, std::move(specs));
  for (const auto& [name, t] : tensors) writer.write(name, t.detach());
  return writer.finish().path;
}

}  // namespace dtrain::checkpoint
