#include "dtrain/checkpoint/safetensors.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "json_fields.h"

namespace dtrain::checkpoint {

using detail::fail;
using detail::json_quoted;

namespace {

struct DtypeRow {
  Dtype dtype;
  const char* name;
  int64_t size;
};
constexpr DtypeRow kDtypes[] = {
    {Dtype::F64, "F64", 8}, {Dtype::F32, "F32", 4}, {Dtype::F16, "F16", 2}, {Dtype::BF16, "BF16", 2},
    {Dtype::I64, "I64", 8}, {Dtype::I32, "I32", 4}, {Dtype::I16, "I16", 2}, {Dtype::I8, "I8", 1},
    {Dtype::U8, "U8", 1},   {Dtype::BOOL, "BOOL", 1},
};

const DtypeRow& row(Dtype d) {
  for (const auto& r : kDtypes) {
    if (r.dtype == d) return r;
  }
  fail("safetensors: invalid Dtype value " + std::to_string(static_cast<int>(d)));
}

std::string known_dtypes() {
  std::string s;
  for (const auto& r : kDtypes) s += std::string(s.empty() ? "" : " ") + r.name;
  return s;
}

std::string prefix(const std::string& file) { return "checkpoint " + file; }

std::string tensor_where(const std::string& file, const std::string& name) {
  return prefix(file) + ": tensor " + json_quoted(name);
}

}  // namespace

const char* dtype_name(Dtype dtype) { return row(dtype).name; }

std::optional<Dtype> dtype_from_name(std::string_view name) {
  for (const auto& r : kDtypes) {
    if (name == r.name) return r.dtype;
  }
  return std::nullopt;
}

int64_t dtype_size(Dtype dtype) { return row(dtype).size; }

std::optional<int64_t> checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  // Also leave room for byte counts of the widest dtype.
  if (n > INT64_MAX / 8) return std::nullopt;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t SafetensorsEntry::numel() const { return checked_numel(shape).value_or(-1); }

const SafetensorsEntry* SafetensorsHeader::find(std::string_view name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

uint64_t parse_safetensors_header_length(const unsigned char* first8, uint64_t file_size,
                                         const std::string& file) {
  if (file_size < 8) {
    fail(prefix(file) + ": " + std::to_string(file_size) +
         "-byte file is too short for the 8-byte header length (truncated?)");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  if (n > kMaxSafetensorsHeaderBytes) {
    fail(prefix(file) + ": header length " + std::to_string(n) + " is above the " +
         std::to_string(kMaxSafetensorsHeaderBytes) + "-byte limit (not a safetensors file?)");
  }
  if (n > file_size - 8) {
    fail(prefix(file) + ": header length " + std::to_string(n) + " goes beyond the " +
         std::to_string(file_size) + "-byte file (truncated?)");
  }
  if (n < 2) fail(prefix(file) + ": header length " + std::to_string(n) + " is too short for a JSON object");
  return n;
}

SafetensorsHeader parse_safetensors_header(std::string_view header_json, uint64_t file_size,
                                           const std::string& file) {
  SafetensorsHeader h;
  h.header_bytes = header_json.size();
  if (h.header_bytes > kMaxSafetensorsHeaderBytes || h.header_bytes > file_size || file_size - h.header_bytes < 8) {
    fail(prefix(file) + ": header of " + std::to_string(h.header_bytes) + " bytes does not fit the " +
         std::to_string(file_size) + "-byte file");
  }
  h.buffer_offset = 8 + h.header_bytes;
  h.buffer_bytes = file_size - h.buffer_offset;
  if (header_json.empty() || header_json[0] != '{') {
    fail(prefix(file) + ": header does not start with '{' (not a safetensors file?)");
  }
  const detail::Json root = detail::parse_json_strict(header_json, prefix(file) + ": header", 8);
  if (!root.is_object()) fail(prefix(file) + ": header must be a JSON object");
  const std::string buffer_desc = std::to_string(h.buffer_bytes) + "-byte buffer";
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == kSafetensorsMetadataKey) {
      h.metadata = detail::as_string_map(*it, prefix(file) + ": \"__metadata__\"");
      continue;
    }
    const std::string where = tensor_where(file, it.key());
    detail::Fields f(*it, where);
    f.only({"dtype", "shape", "data_offsets"});
    SafetensorsEntry e;
    e.name = it.key();
    const std::string dt = f.string("dtype");
    const auto dtype = dtype_from_name(dt);
    if (!dtype) fail(where + ": unknown dtype " + json_quoted(dt) + " (known: " + known_dtypes() + ")");
    e.dtype = *dtype;
    e.shape = detail::as_shape(f.get("shape"), where + ": shape");
    const detail::Json& off = f.array("data_offsets");
    if (off.size() != 2) {
      fail(where + ": data_offsets must have 2 entries [begin, end], got " + std::to_string(off.size()));
    }
    e.begin = detail::as_uint64(off[0], where + ": data_offsets[0]");
    e.end = detail::as_uint64(off[1], where + ": data_offsets[1]");
    const std::string range = "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + "]";
    if (e.begin > e.end) fail(where + ": " + range + " begin after end");
    if (e.end > h.buffer_bytes) fail(where + ": " + range + " end beyond the " + buffer_desc);
    const uint64_t bytes = static_cast<uint64_t>(*checked_numel(e.shape)) * dtype_size(e.dtype);
    if (bytes != e.end - e.begin) {
      fail(where + ": shape " + shape_string(e.shape) + " of " + dt + " needs " + std::to_string(bytes) +
           " bytes but " + range + " hold " + std::to_string(e.end - e.begin));
    }
    h.entries.push_back(std::move(e));
  }
  std::sort(h.entries.begin(), h.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t at = 0;
  for (size_t i = 0; i < h.entries.size(); ++i) {
    const auto& e = h.entries[i];
    if (e.begin < at) {
      fail(tensor_where(file, e.name) + ": data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "] overlap tensor " + json_quoted(h.entries[i - 1].name) + " (which ends at " +
           std::to_string(at) + ")");
    }
    if (e.begin > at) {
      fail(tensor_where(file, e.name) + ": bytes [" + std::to_string(at) + ", " + std::to_string(e.begin) +
           ") of the buffer before it belong to no tensor");
    }
    at = e.end;
  }
  if (at != h.buffer_bytes) {
    fail(prefix(file) + ": the tensors end at byte " + std::to_string(at) + " of the " + buffer_desc +
         " (trailing bytes belong to no tensor)");
  }
  return h;
}

SafetensorsHeader parse_safetensors_prefix(std::string_view file_prefix, uint64_t file_size,
                                           const std::string& file) {
  if (file_prefix.size() < 8 || file_prefix.size() > file_size) {
    fail(prefix(file) + ": " + std::to_string(file_prefix.size()) + " bytes read of a " +
         std::to_string(file_size) + "-byte file: too short for the 8-byte header length");
  }
  const uint64_t n = parse_safetensors_header_length(
      reinterpret_cast<const unsigned char*>(file_prefix.data()), file_size, file);
  if (file_prefix.size() - 8 < n) {
    fail(prefix(file) + ": header length " + std::to_string(n) + " goes beyond the " +
         std::to_string(file_prefix.size()) + " bytes read");
  }
  return parse_safetensors_header(file_prefix.substr(8, n), file_size, file);
}

SafetensorsHeader lay_out_safetensors(const std::vector<SafetensorsTensorSpec>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      std::string* out_prefix, const std::string& file) {
  SafetensorsHeader h;
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) j[kSafetensorsMetadataKey] = metadata;
  std::set<std::string> names;
  uint64_t at = 0;
  for (const auto& t : tensors) {
    const std::string where = tensor_where(file, t.name);
    if (t.name == kSafetensorsMetadataKey) fail(where + ": the name is reserved for metadata");
    if (!names.insert(t.name).second) fail(where + ": two tensors have this name");
    const auto numel = checked_numel(t.shape);
    if (!numel) fail(where + ": shape " + shape_string(t.shape) + " has a negative or too large dimension");
    SafetensorsEntry e{t.name, t.dtype, t.shape, at, 0};
    if (__builtin_add_overflow(at, static_cast<uint64_t>(*numel * dtype_size(t.dtype)), &e.end)) {
      fail(where + ": the file would exceed 2^64 bytes");
    }
    at = e.end;
    j[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {e.begin, e.end}}};
    h.entries.push_back(std::move(e));
  }
  std::string json;
  try {
    json = j.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::ordered_json::error_handler_t::strict);
  } catch (const nlohmann::json::exception& e) {
    fail(prefix(file) + ": a tensor name or metadata string is not valid UTF-8 (" + e.what() + ")");
  }
  json.append((8 - json.size() % 8) % 8, ' ');  // the buffer starts 8-byte aligned
  h.header_bytes = json.size();
  h.buffer_offset = 8 + h.header_bytes;
  h.buffer_bytes = at;
  h.metadata = metadata;
  if (out_prefix) {
    out_prefix->resize(8);
    for (int i = 0; i < 8; ++i) (*out_prefix)[i] = static_cast<char>((h.header_bytes >> (8 * i)) & 0xff);
    out_prefix->append(json);
  }
  return h;
}

}  // namespace dtrain::checkpoint
