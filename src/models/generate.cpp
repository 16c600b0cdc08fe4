#include "dtrain/models/generate.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace dtrain::models {

std::vector<int64_t> generate(const LogitsFn& logits, int64_t context, std::vector<int64_t> prompt,
                              const GenerateOptions& o) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt has no tokens");
  if (o.temperature() < 0) throw std::invalid_argument("--temperature must be >= 0, got " + std::to_string(o.temperature()));
  if (o.top_k() < 0) throw std::invalid_argument("--top-k must be >= 0, got " + std::to_string(o.top_k()));
  if (context < 1) throw std::invalid_argument("generate: the context must be at least one token");
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed());
  for (int64_t n = 0; n < o.max_new_tokens(); ++n) {
    const int64_t from = std::max<int64_t>(0, static_cast<int64_t>(prompt.size()) - context);
    const auto window = at::tensor(std::vector<int64_t>(prompt.begin() + from, prompt.end()), at::kLong).unsqueeze(0);
    at::Tensor last = logits(window).select(1, -1).squeeze(0).to(at::kCPU, at::kDouble);  // [vocab]
    int64_t next;
    if (o.temperature() == 0) {
      next = last.argmax().item<int64_t>();
    } else {
      last = last / o.temperature();
      if (o.top_k() > 0 && o.top_k() < last.size(0)) {
        const double kth = std::get<0>(last.topk(o.top_k())).min().item<double>();
        last = last.masked_fill(last < kth, -std::numeric_limits<double>::infinity());
      }
      next = at::multinomial(at::softmax(last, 0), 1, false, gen).item<int64_t>();
    }
    prompt.push_back(next);
  }
  return prompt;
}

}  // namespace dtrain::models
