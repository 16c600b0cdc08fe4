#pragma once
// dtrain-gpt's text <-> tokens for --generate: bytes (vocabulary 256), or a SentencePiece model
// (--tokenizer FILE, dtrain-tokenize's tokenizer.model) through dtrain-tokenize beside this
// program (Design note [sentencepiece in its own process], tools/dtrain_tokenize.cpp).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtrain/util/fs.h"
#include "dtrain/util/parse.h"

extern char** environ;

class Tokenizer {
 public:
  explicit Tokenizer(std::string model) : model_(std::move(model)) {
    if (model_.empty()) return;
    const auto self = dtrain::util::fs::read_symlink("/proc/self/exe");
    tool_ = dtrain::util::fs::join(dtrain::util::fs::parent_path(self.value_or("")), "dtrain-tokenize");
    if (::access(tool_.c_str(), X_OK) != 0) {
      throw std::invalid_argument("--tokenizer needs dtrain-tokenize beside dtrain-gpt (" + tool_ +
                                  "; built where libsentencepiece-dev is installed)");
    }
    std::string size = ask({"--vocab"});
    while (!size.empty() && (size.back() == '\n' || size.back() == ' ')) size.pop_back();
    const auto v = dtrain::util::parse_int(size);
    if (!v) throw std::invalid_argument("--tokenizer " + model_ + ": dtrain-tokenize gave no vocabulary size");
    vocab_ = *v;
  }
  int64_t vocab_size() const { return vocab_; }
  std::vector<int64_t> encode(const std::string& text) const {
    if (model_.empty()) {
      return std::vector<int64_t>(reinterpret_cast<const unsigned char*>(text.data()),
                                  reinterpret_cast<const unsigned char*>(text.data()) + text.size());
    }
    std::vector<int64_t> ids;
    std::istringstream in(ask({"--encode", text}));
    for (int64_t id; in >> id;) ids.push_back(id);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const {
    if (model_.empty()) {
      std::string text;
      for (int64_t t : ids) text += static_cast<char>(static_cast<unsigned char>(t));
      return text;
    }
    std::string list;
    for (int64_t t : ids) list += std::to_string(t) + " ";
    std::string text = ask({"--decode", list});
    if (!text.empty() && text.back() == '\n') text.pop_back();
    return text;
  }

 private:
  // dtrain-tokenize --model FILE <args>: its standard output (its errors an exception).
  std::string ask(const std::vector<std::string>& args) const {
    std::vector<std::string> argv_s{tool_, "--model", model_};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (::pipe(out) != 0) throw std::runtime_error("--tokenizer: cannot make a pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    pid_t pid;
    const int rc = posix_spawn(&pid, tool_.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    if (rc != 0) {
      ::close(out[0]);
      throw std::runtime_error("--tokenizer: cannot run " + tool_);
    }
    std::string text;
    char buf[4096];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) text.append(buf, static_cast<size_t>(n));
    ::close(out[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      throw std::invalid_argument("--tokenizer " + model_ + ": dtrain-tokenize failed (see its message above)");
    }
    return text;
  }

  std::string model_, tool_;
  int64_t vocab_ = 256;
};
