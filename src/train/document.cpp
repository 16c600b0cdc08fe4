// Configuration documents (--config FILE): TOML through toml++, JSON through nlohmann/json, both
// as Debian packages them. Flat: one key per flag, with a string, number or boolean value.
#include <charconv>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>
#define TOML_EXCEPTIONS 1
#include <toml++/toml.h>

#include "keys.h"

namespace dtrain::train::detail {
namespace {

std::string dashed(std::string key) {
  for (char& c : key) c = c == '_' ? '-' : c;
  return key;
}

std::string double_text(double x) {
  char buf[40];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, x).ptr);  // (the shortest text that reads back as x)
}

std::vector<std::pair<std::string, std::string>> from_toml(const toml::table& table, const std::string& source) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [key, node] : table) {
    const std::string name(key.str());
    if (auto s = node.value_exact<std::string>()) {
      out.emplace_back(dashed(name), *s);
    } else if (auto b = node.value_exact<bool>()) {
      out.emplace_back(dashed(name), *b ? "true" : "false");
    } else if (auto i = node.value_exact<int64_t>()) {
      out.emplace_back(dashed(name), std::to_string(*i));
    } else if (auto d = node.value_exact<double>()) {
      out.emplace_back(dashed(name), double_text(*d));
    } else {
      throw std::invalid_argument(source + ": " + name + " must be a string, a number or true/false (the document "
                                  "is flat: one key per flag)");
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> from_json(const nlohmann::json& doc, const std::string& source) {
  if (!doc.is_object()) throw std::invalid_argument(source + ": the document must be one JSON object of flags");
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [key, v] : doc.items()) {
    if (v.is_string()) {
      out.emplace_back(dashed(key), v.get<std::string>());
    } else if (v.is_boolean()) {
      out.emplace_back(dashed(key), v.get<bool>() ? "true" : "false");
    } else if (v.is_number_integer()) {
      out.emplace_back(dashed(key), std::to_string(v.get<int64_t>()));
    } else if (v.is_number()) {
      out.emplace_back(dashed(key), double_text(v.get<double>()));
    } else {
      throw std::invalid_argument(source + ": " + key + " must be a string, a number or true/false (the document is "
                                  "flat: one key per flag)");
    }
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& end) {
  return s.size() >= end.size() && s.compare(s.size() - end.size(), end.size(), end) == 0;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> read_toml_text(const std::string& text, const std::string& source) {
  try {
    return from_toml(toml::parse(text, source), source);
  } catch (const toml::parse_error& e) {
    throw std::invalid_argument(source + ":" + std::to_string(e.source().begin.line) + ": " + std::string(e.description()));
  }
}

std::vector<std::pair<std::string, std::string>> read_document(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("--config " + path + ": cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  if (ends_with(path, ".toml")) return read_toml_text(text.str(), path);
  if (ends_with(path, ".json")) {
    try {
      return from_json(nlohmann::json::parse(text.str()), path);
    } catch (const nlohmann::json::parse_error& e) {
      throw std::invalid_argument(path + ": " + e.what());
    }
  }
  throw std::invalid_argument("--config " + path + ": a configuration document is TOML (.toml) or JSON (.json)");
}

}  // namespace dtrain::train::detail
