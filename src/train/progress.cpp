#include "dtrain/train/progress.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace dtrain::train {

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const long s = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld", s / 60, s % 60);
  }
  return buf;
}

Progress::Progress(int64_t total_steps, bool interactive, std::FILE* out)
    : total_(std::max<int64_t>(1, total_steps)),
      interactive_(interactive),
      out_(out),
      every_(std::max<int64_t>(1, total_ / 20)),
      start_(std::chrono::steady_clock::now()) {}

bool Progress::stdout_is_interactive() {
  const char* dtrun = std::getenv("DTRAIN_STDOUT_ISATTY");
  if (dtrun && std::string(dtrun) == "1") return true;
  return isatty(STDOUT_FILENO) == 1;
}

void Progress::update(int64_t step, double loss, double tokens_per_s) {
  const auto now = std::chrono::steady_clock::now();
  if (first_step_ < 0) {
    first_step_ = step;
    start_ = now;
  }
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const int64_t done = step - first_step_;
  const double eta = done > 0 ? elapsed / done * (total_ - step) : -1;
  char tps[32];
  if (tokens_per_s >= 1e6) {
    std::snprintf(tps, sizeof(tps), "%.2fM", tokens_per_s / 1e6);
  } else if (tokens_per_s >= 1e3) {
    std::snprintf(tps, sizeof(tps), "%.1fk", tokens_per_s / 1e3);
  } else {
    std::snprintf(tps, sizeof(tps), "%.0f", tokens_per_s);
  }
  if (interactive_) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * step / total_);
    std::string bar(filled, '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_, "\rstep %lld/%lld [%s] loss %.4f | %s tok/s | ETA %s   ", static_cast<long long>(step),
                 static_cast<long long>(total_), bar.c_str(), loss, tps, format_duration(eta).c_str());
    std::fflush(out_);
  } else if (step % every_ == 0 || step == total_ || step == 1) {
    std::fprintf(out_, "step %lld/%lld loss %.4f %s tok/s ETA %s\n", static_cast<long long>(step),
                 static_cast<long long>(total_), loss, tps, format_duration(eta).c_str());
    std::fflush(out_);
  }
}

void Progress::finish() {
  if (interactive_) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
  }
}

}  // namespace dtrain::train
