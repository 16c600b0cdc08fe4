#pragma once
// Helpers shared by the checkpoint tests.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

namespace dtrain::checkpoint::testing {

// Runs f and returns the c10::Error's message without backtrace ("" if nothing was thrown).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

}  // namespace dtrain::checkpoint::testing

// Expects `stmt` to throw a c10::Error whose message contains `needle`.
#define EXPECT_ERROR_WITH(stmt, needle)                                                       \
  do {                                                                                        \
    const std::string msg_ = ::dtrain::checkpoint::testing::error_of([&] { stmt; });          \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "expected an error containing: " << (needle) \
                                                    << "\n got: " << (msg_.empty() ? "(no error)" : msg_); \
  } while (0)
