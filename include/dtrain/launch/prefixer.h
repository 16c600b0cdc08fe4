#pragma once
// OutputPrefixer: cuts one worker stream (its stdout or its stderr) into segments and forwards
// each with the worker's prefix, so lines of different ranks never mix within a line.
//
// Segments:
//   "text\n"   a line: forwarded as prefix + "text\n" ("\r\n" counts as one line ending).
//   "text\r"   a progress update: forwarded at once as prefix + "text\r", so a progress bar
//              redraws in place. A lone "\r" with no text before it is dropped.
//   "text"     an unfinished line: held until its '\n' or '\r' arrives; forwarded with an added
//              '\n' at the end of the stream (finish()) or when it grows past kMaxSegment bytes.
// Each forwarded segment is one sink call, so a sink that does one write() per call keeps lines
// whole even when several workers share dtrun's stdout.
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace dtrain::launch {

class OutputPrefixer {
 public:
  using Sink = std::function<void(std::string_view)>;
  static constexpr std::size_t kMaxSegment = 64 * 1024;

  OutputPrefixer(std::string prefix, Sink sink);

  // Forwards every complete segment in `data`, keeps the unfinished tail.
  void feed(std::string_view data);
  // End of the stream: forwards a held unfinished line with '\n' appended.
  void finish();
  // Bytes held back (an unfinished line).
  std::size_t pending() const { return pending_.size(); }

 private:
  void emit(std::string_view segment);

  std::string prefix_;
  Sink sink_;
  std::string pending_;
  bool after_cr_ = false;  // the last forwarded segment ended in '\r' (a following '\n' ends it)
};

}  // namespace dtrain::launch
