#include "dtrain/train/metrics.h"

#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace dtrain::train {

namespace {
std::string number(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN/Inf
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}
}  // namespace

void JsonLine::key(const std::string& k) {
  if (!body_.empty()) body_ += ", ";
  body_ += quoted(k) + ": ";
}
JsonLine& JsonLine::add(const std::string& k, double v) { key(k); body_ += number(v); return *this; }
JsonLine& JsonLine::add(const std::string& k, int64_t v) { key(k); body_ += std::to_string(v); return *this; }
JsonLine& JsonLine::add(const std::string& k, bool v) { key(k); body_ += v ? "true" : "false"; return *this; }
JsonLine& JsonLine::add(const std::string& k, const std::string& v) { key(k); body_ += quoted(v); return *this; }
JsonLine& JsonLine::add(const std::string& k, const std::vector<double>& vs) {
  key(k);
  body_ += "[";
  for (size_t i = 0; i < vs.size(); ++i) body_ += (i ? ", " : "") + number(vs[i]);
  body_ += "]";
  return *this;
}

MetricsWriter::MetricsWriter(const std::string& path, bool append)
    : out_(path, append ? std::ios::app : std::ios::trunc), path_(path) {
  if (!out_) throw std::runtime_error("cannot open metrics file '" + path + "' for writing");
}

int64_t last_step_recorded(const std::string& path) {
  std::ifstream in(path);
  int64_t last = 0;
  const std::string field = "\"step\": ";
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find(field);
    if (at != std::string::npos && line.find("\"loss\": ") != std::string::npos) last = std::stoll(line.substr(at + field.size()));
  }
  return last;
}

void MetricsWriter::write(const JsonLine& line) {
  if (!out_.is_open()) return;
  out_ << line.str() << '\n';
  out_.flush();
  if (!out_) throw std::runtime_error("writing metrics file '" + path_ + "' failed");
}

}  // namespace dtrain::train
