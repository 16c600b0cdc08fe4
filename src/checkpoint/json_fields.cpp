#include "json_fields.h"

#include <algorithm>
#include <set>

#include "dtrain/checkpoint/safetensors.h"

namespace dtrain::checkpoint::detail {

namespace {

// nlohmann's DOM builder plus: reject repeated keys within an object and deep nesting, and keep
// the parse error's text instead of throwing.
class StrictSax : public nlohmann::detail::json_sax_dom_parser<Json> {
  using Base = nlohmann::detail::json_sax_dom_parser<Json>;

 public:
  StrictSax(Json& root, int max_depth) : Base(root, /*allow_exceptions=*/false), max_depth_(max_depth) {}

  bool start_object(std::size_t n) {
    if (!enter()) return false;
    keys_.emplace_back();
    in_object_.push_back(true);
    return Base::start_object(n);
  }
  bool end_object() {
    keys_.pop_back();
    in_object_.pop_back();
    return Base::end_object();
  }
  bool start_array(std::size_t n) {
    if (!enter()) return false;
    in_object_.push_back(false);
    return Base::start_array(n);
  }
  bool end_array() {
    in_object_.pop_back();
    return Base::end_array();
  }
  bool key(Json::string_t& k) {
    if (!keys_.back().insert(k).second) {
      error_ = "key " + json_quoted(k) + " appears twice in one object";
      return false;
    }
    return Base::key(k);
  }
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception& ex) {
    // The position and the kind of error, never the bytes read (a file given by mistake may hold
    // anything): nlohmann's message ends in "; last read: '<text>'".
    error_ = ex.what();
    const auto cut = error_.find("; last read");
    if (cut != std::string::npos) error_.erase(cut);
    return false;
  }
  const std::string& error() const { return error_; }

 private:
  bool enter() {
    if (static_cast<int>(in_object_.size()) >= max_depth_) {
      error_ = "nested deeper than " + std::to_string(max_depth_) + " levels";
      return false;
    }
    return true;
  }
  int max_depth_;
  std::vector<std::set<std::string>> keys_;
  std::vector<bool> in_object_;
  std::string error_;
};

}  // namespace

void fail(const std::string& message) { throw FormatError(message); }

std::string json_quoted(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

Json parse_json_strict(std::string_view text, const std::string& where, int max_depth) {
  Json root;
  StrictSax sax(root, max_depth);
  const bool ok = Json::sax_parse(text.begin(), text.end(), &sax, nlohmann::detail::input_format_t::json,
                                  /*strict=*/true);
  if (!ok || !sax.error().empty()) {
    fail(where + ": not valid JSON: " + (sax.error().empty() ? std::string("parse error") : sax.error()));
  }
  return root;
}

Fields::Fields(const Json& value, std::string where) : value_(value), where_(std::move(where)) {
  if (!value_.is_object()) fail(where_ + ": expected a JSON object, got " + value_.type_name());
}

bool Fields::has(const char* name) const { return value_.contains(name); }

const Json& Fields::get(const char* name) const {
  auto it = value_.find(name);
  if (it == value_.end()) fail(where_ + ": field \"" + name + "\" is missing");
  return *it;
}

std::string Fields::string(const char* name) const {
  const Json& v = get(name);
  if (!v.is_string()) fail(where_ + ": field \"" + name + "\" must be a string, got " + v.type_name());
  return v.get<std::string>();
}

int64_t Fields::int64(const char* name, int64_t min, int64_t max) const {
  return as_int64(get(name), where_ + ": field \"" + name + "\"", min, max);
}

uint64_t Fields::uint64(const char* name) const {
  return as_uint64(get(name), where_ + ": field \"" + name + "\"");
}

const Json& Fields::array(const char* name) const {
  const Json& v = get(name);
  if (!v.is_array()) fail(where_ + ": field \"" + name + "\" must be an array, got " + v.type_name());
  return v;
}

const Json& Fields::object(const char* name) const {
  const Json& v = get(name);
  if (!v.is_object()) fail(where_ + ": field \"" + name + "\" must be an object, got " + v.type_name());
  return v;
}

void Fields::only(std::initializer_list<const char*> known) const {
  for (auto it = value_.begin(); it != value_.end(); ++it) {
    const bool ok = std::any_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; });
    if (!ok) fail(where_ + ": unknown field " + json_quoted(it.key()));
  }
}

int64_t as_int64(const Json& v, const std::string& what, int64_t min, int64_t max) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) fail(what + " = " + std::to_string(u) + " is too large");
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    fail(what + " must be an integer, got " + (v.is_number() ? v.dump() : std::string(v.type_name())));
  }
  if (x < min) fail(what + " = " + std::to_string(x) + " is below " + std::to_string(min));
  if (x > max) fail(what + " = " + std::to_string(x) + " is above " + std::to_string(max));
  return x;
}

uint64_t as_uint64(const Json& v, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) fail(what + " = " + v.dump() + " is negative");
  fail(what + " must be an integer, got " + (v.is_number() ? v.dump() : std::string(v.type_name())));
}

std::vector<int64_t> as_shape(const Json& v, const std::string& what) {
  if (!v.is_array()) fail(what + " must be an array of integers, got " + v.type_name());
  std::vector<int64_t> shape;
  for (size_t i = 0; i < v.size(); ++i) {
    shape.push_back(as_int64(v[i], what + "[" + std::to_string(i) + "]", 0));
  }
  if (!checked_numel(shape)) fail(what + " " + shape_string(shape) + " has more elements than int64 can count");
  return shape;
}

std::map<std::string, std::string> as_string_map(const Json& v, const std::string& what) {
  if (!v.is_object()) fail(what + " must be an object of strings, got " + v.type_name());
  std::map<std::string, std::string> out;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it->is_string()) {
      fail(what + ": value of " + json_quoted(it.key()) + " must be a string, got " + it->type_name());
    }
    out[it.key()] = it->get<std::string>();
  }
  return out;
}

}  // namespace dtrain::checkpoint::detail
