#pragma once
// Training metrics as JSON lines (one object per line), written by rank 0.
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::train {

// A flat JSON object built field by field: {"step": 3, "loss": 2.5, ...}.
class JsonLine {
 public:
  JsonLine& add(const std::string& key, double value);
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonLine& add(const std::string& key, bool value);
  JsonLine& add(const std::string& key, const std::string& value);
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, const std::vector<double>& values);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& k);
  std::string body_;
};

// The last step a metrics file records (its last line with "step" and "loss"); 0 when none.
int64_t last_step_recorded(const std::string& path);

class MetricsWriter {
 public:
  MetricsWriter() = default;  // disabled
  // Truncates (or with `append` adds to the end: a new rank 0 after an elastic recovery); throws if
  // it cannot be opened.
  explicit MetricsWriter(const std::string& path, bool append = false);
  bool enabled() const { return out_.is_open(); }
  void write(const JsonLine& line);  // one line, flushed

 private:
  std::ofstream out_;
  std::string path_;
};

}  // namespace dtrain::train
