#include "dtrain/launch/prefixer.h"

#include <utility>

namespace dtrain::launch {

OutputPrefixer::OutputPrefixer(std::string prefix, Sink sink)
    : prefix_(std::move(prefix)), sink_(std::move(sink)) {}

void OutputPrefixer::emit(std::string_view segment) {
  std::string out;
  out.reserve(prefix_.size() + segment.size());
  out.append(prefix_).append(segment);
  sink_(out);
}

void OutputPrefixer::feed(std::string_view data) {
  while (!data.empty()) {
    // A '\n' right after a forwarded "...\r" finishes that line ("\r\n" split across reads).
    if (after_cr_ && pending_.empty() && data.front() == '\n') {
      sink_("\n");
      data.remove_prefix(1);
      after_cr_ = false;
      continue;
    }
    after_cr_ = false;
    std::size_t end = data.find_first_of("\r\n");
    if (end == std::string_view::npos) {
      pending_.append(data);
      if (pending_.size() >= kMaxSegment) {
        pending_.push_back('\n');
        emit(pending_);
        pending_.clear();
      }
      return;
    }
    std::size_t len = end + 1;
    bool is_cr = data[end] == '\r';
    if (is_cr && len < data.size() && data[len] == '\n') {
      ++len;  // "\r\n": an ordinary line ending
      is_cr = false;
    }
    pending_.append(data.substr(0, len));
    data.remove_prefix(len);
    if (is_cr && pending_.size() == 1) {
      pending_.clear();  // a bare "\r": nothing to show
      continue;
    }
    emit(pending_);
    pending_.clear();
    after_cr_ = is_cr;
  }
}

void OutputPrefixer::finish() {
  if (!pending_.empty()) {
    pending_.push_back('\n');
    emit(pending_);
    pending_.clear();
  }
  after_cr_ = false;
}

}  // namespace dtrain::launch
