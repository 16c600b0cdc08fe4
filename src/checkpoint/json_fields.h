#pragma once
// Strict JSON reading for the checkpoint parsers (libtorch-free): no duplicate keys, bounded
// nesting, and typed field access whose errors name the file and the field.
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtrain::checkpoint::detail {

using Json = nlohmann::json;

// Parses `text` as one JSON value. Throws FormatError "<where>: not valid JSON: ..." for malformed
// input, a key repeated within an object, or nesting deeper than `max_depth`.
Json parse_json_strict(std::string_view text, const std::string& where, int max_depth = 16);

// Typed access to the fields of one JSON object; `where` prefixes every error
// (e.g. "checkpoint f.safetensors: tensor \"w\"").
class Fields {
 public:
  // Throws unless `value` is an object.
  Fields(const Json& value, std::string where);
  const std::string& where() const { return where_; }
  bool has(const char* name) const;
  const Json& get(const char* name) const;  // throws if missing
  std::string string(const char* name) const;
  int64_t int64(const char* name, int64_t min, int64_t max = INT64_MAX) const;
  uint64_t uint64(const char* name) const;
  const Json& array(const char* name) const;
  const Json& object(const char* name) const;
  // Throws naming the first field not in `known`.
  void only(std::initializer_list<const char*> known) const;

 private:
  const Json& value_;
  std::string where_;
};

// A JSON integer as int64 in [min, max]; `what` names it in errors.
int64_t as_int64(const Json& v, const std::string& what, int64_t min, int64_t max = INT64_MAX);
uint64_t as_uint64(const Json& v, const std::string& what);
// An array of non-negative int64 (a shape); `what` names it in errors.
std::vector<int64_t> as_shape(const Json& v, const std::string& what);
// A JSON object of strings.
std::map<std::string, std::string> as_string_map(const Json& v, const std::string& what);
// "\"name\"" as JSON writes it (quotes, escapes), for error messages.
std::string json_quoted(std::string_view s);

[[noreturn]] void fail(const std::string& message);

}  // namespace dtrain::checkpoint::detail
