#include "dtrain/pipeline/stage.h"

#include <sstream>
#include <stdexcept>

namespace dtrain::pipeline {

Stage make_stage(const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules,
                 std::function<at::Tensor(const at::Tensor&)> forward) {
  auto m = std::make_shared<torch::nn::Module>();
  for (const auto& [name, module] : modules) m->register_module(name, module);
  return Stage{m, std::move(forward)};
}

std::vector<int64_t> even_starts(int64_t count, int n, const std::string& what) {
  if (n < 1) throw std::invalid_argument("a pipeline needs at least 1 stage (got " + std::to_string(n) + ")");
  if (n > count)
    throw std::invalid_argument("cannot cut " + std::to_string(count) + " " + what + " into " + std::to_string(n) +
                                " pipeline stages: more stages than " + what + " (lower --pp or --virtual-stages)");
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (int k = 0; k < n; ++k) {
    starts.push_back(at);
    at += count / n + (k < count % n ? 1 : 0);
  }
  return starts;
}

std::vector<Stage> split_sequential(const torch::nn::Sequential& model, int n, std::vector<int64_t> starts) {
  const int64_t size = static_cast<int64_t>(model->size());
  if (starts.empty()) starts = even_starts(size, n, "modules of the Sequential");
  if (static_cast<int>(starts.size()) != n || starts.front() != 0) {
    std::ostringstream o;
    o << "split_sequential: " << n << " stages need " << n << " start indices beginning with 0 (got " << starts.size()
      << ")";
    throw std::invalid_argument(o.str());
  }
  for (int k = 1; k < n; ++k) {
    if (starts[k] <= starts[k - 1] || starts[k] >= size)
      throw std::invalid_argument("split_sequential: stage " + std::to_string(k) + " starts at child " +
                                  std::to_string(starts[k]) + ", which is not after stage " + std::to_string(k - 1) +
                                  "'s start (" + std::to_string(starts[k - 1]) + ") and inside the " +
                                  std::to_string(size) + " children");
  }
  const auto names = model->named_children();
  std::vector<Stage> stages;
  for (int k = 0; k < n; ++k) {
    const int64_t end = k + 1 < n ? starts[k + 1] : size;
    torch::nn::Sequential part;
    for (int64_t i = starts[k]; i < end; ++i) part->push_back(names[i].key(), *(model->begin() + i));
    stages.push_back(Stage{part.ptr(), [part](const at::Tensor& x) mutable { return part->forward(x); }});
  }
  return stages;
}

}  // namespace dtrain::pipeline
