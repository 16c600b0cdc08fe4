#pragma once
// The request's keys (config.h), shared by the command line, configuration documents and
// --print-config (src/train/).
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/train/config.h"

namespace dtrain::train::detail {

struct Key {
  std::string name;  // as a flag without "--" ("batch-size"); documents may write '_' for '-'
  bool is_switch;    // a flag without a value on the command line; true/false in a document
  std::function<void(TrainConfig&, const std::string&)> set;  // from its text; throws naming the flag
  std::function<std::string(const TrainConfig&)> get;        // as a TOML value
};

const std::vector<Key>& keys();
const Key* find_key(const std::string& name);
// `s` as a TOML string.
std::string quoted(const std::string& s);
// The known name at most 3 edits from `name` ("" when none).
std::string nearest(const std::string& name, const std::vector<std::string>& known);

// A configuration document's keys and values as text (strings unquoted, booleans "true"/"false"),
// in the document's order; '_' in keys read as '-'. TOML by a .toml name, JSON by .json; throws
// std::invalid_argument naming the file, and the line where the parser gives one.
std::vector<std::pair<std::string, std::string>> read_document(const std::string& path);
// The same from TOML text (e.g. a checkpoint's run/config).
std::vector<std::pair<std::string, std::string>> read_toml_text(const std::string& text, const std::string& source);

}  // namespace dtrain::train::detail
