#pragma once
// Rank 0's view of a run: a progress bar (loss, tokens/s, ETA) updated in place on a terminal,
// plain periodic lines otherwise (logs, CI, or under a launcher that is not on a terminal).
#include <chrono>
#include <cstdio>
#include <string>

namespace dtrain::train {

class Progress {
 public:
  // interactive: draw a bar with '\r'; otherwise print a line every `every` steps and the last.
  Progress(int64_t total_steps, bool interactive, std::FILE* out = stdout);
  // True when stdout is a terminal, or dtrun says its own stdout is (DTRAIN_STDOUT_ISATTY=1).
  static bool stdout_is_interactive();

  void update(int64_t step, double loss, double tokens_per_s);  // step counts from 1
  void finish();

 private:
  int64_t total_;
  bool interactive_;
  std::FILE* out_;
  int64_t every_;
  int64_t first_step_ = -1;
  std::chrono::steady_clock::time_point start_;
};

// "1:02:03" / "4:05".
std::string format_duration(double seconds);

}  // namespace dtrain::train
