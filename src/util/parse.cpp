#include "dtrain/util/parse.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace dtrain::util {

std::optional<int64_t> parse_int(std::string_view text) {
  int64_t out = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, out);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return out;
}

std::optional<double> parse_double(std::string_view text) {
  const std::string s(text);  // strtod needs a terminated string
  if (s.empty() || std::isspace(static_cast<unsigned char>(s.front()))) return std::nullopt;
  char* end = nullptr;
  const double out = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(out)) return std::nullopt;
  return out;
}

std::optional<int64_t> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  auto x = parse_int(v);
  if (!x) throw std::invalid_argument(std::string(name) + " must be an integer, got '" + v + "'");
  return x;
}

}  // namespace dtrain::util
