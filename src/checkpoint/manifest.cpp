#include "dtrain/checkpoint/manifest.h"

#include <algorithm>
#include <set>

#include "dtrain/checkpoint/sha256.h"
#include "json_fields.h"

namespace dtrain::checkpoint {

using detail::fail;
using detail::json_quoted;

namespace {

constexpr int64_t kMaxWorldSize = 1 << 24;

std::string range_string(int64_t b, int64_t e) {
  return "[" + std::to_string(b) + ", " + std::to_string(e) + ")";
}

std::string piece_string(const ManifestPiece& p) {
  return range_string(p.begin, p.begin + p.numel) + " (" + p.file + " tensor " + json_quoted(p.tensor) + ")";
}

bool is_lower_hex(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

void check_file_name(const std::string& name, const std::string& where) {
  if (name.empty() || name[0] == '.' || name.find('/') != std::string::npos ||
      name.find('\\') != std::string::npos || name.find('\0') != std::string::npos || name == kManifestFileName) {
    fail(where + ": file name " + json_quoted(name) +
         " must be a plain file name in the checkpoint directory (no '/', not starting with '.')");
  }
}

}  // namespace

int64_t ManifestTensor::numel() const { return checked_numel(shape).value_or(-1); }

const ManifestFile* Manifest::file(std::string_view name) const {
  for (const auto& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

void validate_manifest(Manifest& m, const std::string& where) {
  if (m.format_version != 1 && m.format_version != kManifestFormatVersion) {
    fail(where + ": format_version " + std::to_string(m.format_version) + " is not supported (this dtrain reads 1 and " +
         std::to_string(kManifestFormatVersion) + ")");
  }
  if (m.step < 0) fail(where + ": step " + std::to_string(m.step) + " is negative");
  if (m.world_size < 1 || m.world_size > kMaxWorldSize) {
    fail(where + ": world_size " + std::to_string(m.world_size) + " is out of range [1, " +
         std::to_string(kMaxWorldSize) + "]");
  }
  std::map<std::string, const ManifestFile*> files;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const auto& f = m.files[i];
    const std::string fw = where + ": files[" + std::to_string(i) + "]";
    check_file_name(f.name, fw);
    if (!files.emplace(f.name, &f).second) fail(fw + ": file " + json_quoted(f.name) + " is listed twice");
    if (f.sha256.size() != 64 || !is_lower_hex(f.sha256)) {
      fail(fw + " (" + f.name + "): sha256 " + json_quoted(f.sha256) + " is not 64 lowercase hex digits");
    }
  }
  std::set<std::pair<std::string, std::string>> used;
  for (auto& [key, t] : m.tensors) {
    const std::string tw = where + ": tensor " + json_quoted(key);
    if (key.empty()) fail(tw + ": the key is empty");
    const auto numel = checked_numel(t.shape);
    if (!numel) fail(tw + ": shape " + shape_string(t.shape) + " has a negative or too large dimension");
    for (const auto& p : t.pieces) {
      const std::string pw = tw + ": piece " + json_quoted(p.tensor) + " in " + json_quoted(p.file);
      auto fit = files.find(p.file);
      if (fit == files.end()) fail(pw + ": file is not in \"files\"");
      if (p.tensor.empty()) fail(pw + ": the tensor name is empty");
      if (!used.emplace(p.file, p.tensor).second) fail(pw + ": this file tensor is used by two pieces");
      if (p.begin < 0 || p.numel < 1 || p.begin > *numel || p.numel > *numel - p.begin) {
        fail(pw + ": elements [" + std::to_string(p.begin) + ", +" + std::to_string(p.numel) +
             ") are not a non-empty range inside the tensor's " + std::to_string(*numel) + " elements");
      }
      if (static_cast<uint64_t>(p.numel * dtype_size(t.dtype)) > fit->second->size) {
        fail(pw + ": " + std::to_string(p.numel) + " x " + dtype_name(t.dtype) + " do not fit in the " +
             std::to_string(fit->second->size) + "-byte file");
      }
    }
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const ManifestPiece& a, const ManifestPiece& b) { return a.begin < b.begin; });
    int64_t at = 0;
    for (size_t i = 0; i < t.pieces.size(); ++i) {
      const auto& p = t.pieces[i];
      if (p.begin < at) {
        fail(tw + ": piece " + piece_string(p) + " overlaps piece " + piece_string(t.pieces[i - 1]));
      }
      if (p.begin > at) {
        fail(tw + ": elements " + range_string(at, p.begin) + " of " + std::to_string(*numel) +
             " are in no piece (missing piece?)");
      }
      at = p.begin + p.numel;
    }
    if (at != *numel) {
      fail(tw + ": elements " + range_string(at, *numel) + " of " + std::to_string(*numel) +
           " are in no piece (missing piece?)");
    }
  }
}

Manifest parse_manifest(std::string_view json, const std::string& where) {
  const detail::Json root = detail::parse_json_strict(json, where, 8);
  detail::Fields f(root, where);
  const std::string format = f.string("format");
  if (format != kManifestFormat) fail(where + ": not a dtrain checkpoint manifest (its \"format\" is not \"dtrain-checkpoint\")");
  Manifest m;
  m.format_version = f.int64("format_version", 0);
  if (m.format_version != 1 && m.format_version != kManifestFormatVersion) validate_manifest(m, where);  // the clear version error first
  if (m.format_version == 1) {
    f.only({"format", "format_version", "step", "world_size", "metadata", "files", "tensors"});
  } else {
    f.only({"format", "format_version", "content_sha256", "step", "world_size", "metadata", "files", "tensors"});
  }
  const std::string content_sha256 = m.format_version == 1 ? std::string() : f.string("content_sha256");
  m.step = f.int64("step", 0);
  m.world_size = f.int64("world_size", 1, kMaxWorldSize);
  m.metadata = detail::as_string_map(f.get("metadata"), where + ": metadata");
  const detail::Json& files = f.array("files");
  for (size_t i = 0; i < files.size(); ++i) {
    detail::Fields ff(files[i], where + ": files[" + std::to_string(i) + "]");
    ff.only({"name", "size", "sha256"});
    m.files.push_back({ff.string("name"), ff.uint64("size"), ff.string("sha256")});
  }
  const detail::Json& tensors = f.object("tensors");
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const std::string tw = where + ": tensor " + json_quoted(it.key());
    detail::Fields tf(*it, tw);
    tf.only({"shape", "dtype", "pieces"});
    ManifestTensor t;
    t.shape = detail::as_shape(tf.get("shape"), tw + ": shape");
    const std::string dt = tf.string("dtype");
    const auto dtype = dtype_from_name(dt);
    if (!dtype) fail(tw + ": unknown dtype " + json_quoted(dt));
    t.dtype = *dtype;
    const detail::Json& pieces = tf.array("pieces");
    for (size_t i = 0; i < pieces.size(); ++i) {
      detail::Fields pf(pieces[i], tw + ": pieces[" + std::to_string(i) + "]");
      pf.only({"file", "tensor", "begin", "numel"});
      t.pieces.push_back({pf.string("file"), pf.string("tensor"), pf.int64("begin", 0), pf.int64("numel", 1)});
    }
    m.tensors.emplace(it.key(), std::move(t));
  }
  validate_manifest(m, where);
  if (m.format_version != 1) {
    const std::string actual = manifest_content_sha256(m);
    if (content_sha256 != actual) {
      fail(where + ": its content does not match its content_sha256 (the manifest was changed or damaged after it "
           "was written: a metadata value, size, hash or piece differs; resume from another checkpoint)");
    }
  }
  return m;
}

namespace {
// The manifest as JSON; content_sha256 ("" for the canonical form it is computed over) goes after the version.
std::string encode(const Manifest& m, int64_t version, const std::string& content_sha256) {
  using OJ = nlohmann::ordered_json;
  OJ j = OJ::object();
  j["format"] = kManifestFormat;
  j["format_version"] = version;
  if (!content_sha256.empty()) j["content_sha256"] = content_sha256;
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  j["metadata"] = OJ(m.metadata);
  OJ files = OJ::array();
  for (const auto& f : m.files) files.push_back(OJ{{"name", f.name}, {"size", f.size}, {"sha256", f.sha256}});
  j["files"] = std::move(files);
  OJ tensors = OJ::object();
  for (const auto& [key, t] : m.tensors) {
    OJ pieces = OJ::array();
    for (const auto& p : t.pieces) {
      pieces.push_back(OJ{{"file", p.file}, {"tensor", p.tensor}, {"begin", p.begin}, {"numel", p.numel}});
    }
    tensors[key] = OJ{{"shape", t.shape}, {"dtype", dtype_name(t.dtype)}, {"pieces", std::move(pieces)}};
  }
  j["tensors"] = std::move(tensors);
  try {
    return j.dump(1, ' ', /*ensure_ascii=*/false, OJ::error_handler_t::strict) + "\n";
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("manifest: a key, name or metadata string is not valid UTF-8 (") + e.what() + ")");
  }
}
}  // namespace

std::string manifest_content_sha256(const Manifest& m) {
  const std::string canonical = encode(m, m.format_version, "");
  return sha256_hex(canonical.data(), canonical.size());
}

std::string encode_manifest(const Manifest& m) {
  Manifest v2 = m;
  v2.format_version = kManifestFormatVersion;
  for (auto& [key, t] : v2.tensors) {  // in the order parse_manifest leaves them, which the hash covers
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const ManifestPiece& a, const ManifestPiece& b) { return a.begin < b.begin; });
  }
  return encode(v2, v2.format_version, manifest_content_sha256(v2));
}

}  // namespace dtrain::checkpoint
