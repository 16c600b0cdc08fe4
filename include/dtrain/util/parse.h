#pragma once
// Strict parsing of command-line and environment values: the whole text must be the number.
// Callers turn std::nullopt into an error that names their flag or variable.
#include <cstdint>
#include <optional>
#include <string_view>

namespace dtrain::util {

std::optional<int64_t> parse_int(std::string_view text);
std::optional<double> parse_double(std::string_view text);  // finite values only
// An environment variable as an integer (nullopt when unset or empty; throws naming it when it is
// not an integer).
std::optional<int64_t> env_int(const char* name);

}  // namespace dtrain::util
