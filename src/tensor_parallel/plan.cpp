#include "dtrain/tensor_parallel/plan.h"

#include <algorithm>
#include <functional>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/tensor_parallel/linear.h"
#include "dtrain/tensor_parallel/regions.h"
#include "dtrain/tensor_parallel/vocab.h"

namespace dtrain::tensor_parallel {

Plan Plan::of(const torch::nn::Module& model, comm::ProcessGroup tp) {
  Plan plan;
  plan.tp_ = std::move(tp);
  // (include_self false: the model need not be held by a shared_ptr; itself is looked at first)
  std::vector<std::pair<std::string, const torch::nn::Module*>> modules{{"", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false)) modules.emplace_back(item.key(), item.value().get());
  for (const auto& [name, m] : modules) {
    const std::string prefix = name.empty() ? "" : name + ".";
    if (const auto* c = dynamic_cast<const ColumnParallelLinearImpl*>(m)) {
      plan.specs_[prefix + "weight"] = {Cut::Rows, c->options.stride()};
      if (c->bias.defined()) plan.specs_[prefix + "bias"] = {Cut::Rows, c->options.stride()};
    } else if (dynamic_cast<const RowParallelLinearImpl*>(m)) {
      plan.specs_[prefix + "weight"] = {Cut::Columns, 1};
    } else if (dynamic_cast<const VocabParallelEmbeddingImpl*>(m)) {
      plan.specs_[prefix + "weight"] = {Cut::Rows, 1};
    }
  }
  return plan;
}

const Plan::Spec& Plan::spec(const std::string& name) const {
  static const Spec whole{};
  auto it = specs_.find(name);
  return it == specs_.end() ? whole : it->second;
}

at::Tensor Plan::full(const std::string& name, const at::Tensor& piece) const {
  const Spec& s = spec(name);
  switch (s.cut) {
    case Cut::Whole:
      return piece.detach();
    case Cut::Columns:
      return all_gather_along(piece, tp_, 1);
    case Cut::Rows:
      return rows_full(piece, tp_, s.stride);
  }
  return piece.detach();
}

at::Tensor Plan::piece(const std::string& name, const at::Tensor& full) const {
  const Spec& s = spec(name);
  switch (s.cut) {
    case Cut::Whole:
      return full.detach();
    case Cut::Columns:
      return slice_along(full, tp_, 1);
    case Cut::Rows:
      return rows_piece(full, tp_, s.stride);
  }
  return full.detach();
}

void load_pieces(torch::nn::Module& model, const torch::nn::Module& full, const Plan& plan) {
  at::NoGradGuard no_grad;
  auto mine = model.named_parameters();
  for (const auto& item : full.named_parameters()) {
    at::Tensor* p = mine.find(item.key());
    TORCH_CHECK(p != nullptr, "tensor parallel: the model has no parameter ", item.key(), " (of the full model)");
    p->copy_(plan.piece(item.key(), item.value()));
  }
}

std::vector<int64_t> Plan::full_shape(const std::string& name, std::vector<int64_t> shape) const {
  const Spec& s = spec(name);
  if (s.cut == Cut::Rows) shape[0] *= tp_.size();
  if (s.cut == Cut::Columns) shape[1] *= tp_.size();
  return shape;
}

std::vector<Plan::Segment> Plan::segments(const std::string& name, const std::vector<int64_t>& piece_shape,
                                          int64_t begin, int64_t count) const {
  const Spec& s = spec(name);
  const int64_t numel = c10::multiply_integers(piece_shape);
  TORCH_CHECK(begin >= 0 && count >= 0 && begin + count <= numel, "tensor parallel: range [", begin, ", ",
              begin + count, ") of ", name, " is outside its piece of ", numel, " elements");
  std::vector<Segment> out;
  if (count == 0) return out;
  if (s.cut == Cut::Whole) return {{begin, begin, count}};
  const int64_t w = tp_.size(), r = tp_.rank();
  // The piece is runs of `len` elements, run j at [j * len, (j + 1) * len), each contiguous in the full tensor.
  int64_t len = 0;
  std::function<int64_t(int64_t)> full_begin;
  if (s.cut == Cut::Rows) {  // full [stride, F / stride, inner]; this rank's k rows of each block
    const int64_t inner = piece_shape.size() > 1 ? numel / piece_shape[0] : 1;
    const int64_t k = piece_shape[0] / s.stride, block = k * w;
    len = k * inner;
    full_begin = [=](int64_t j) { return (j * block + r * k) * inner; };
  } else {  // Columns: piece [O, c] of full [O, c * w]
    TORCH_CHECK(piece_shape.size() == 2, "tensor parallel: a column cut needs a matrix, ", name, " is not one");
    const int64_t c = piece_shape[1];
    len = c;
    full_begin = [=](int64_t j) { return j * c * w + r * c; };
  }
  if (len == 0) return out;
  for (int64_t j = begin / len; j * len < begin + count; ++j) {
    const int64_t lo = std::max(begin, j * len), hi = std::min(begin + count, (j + 1) * len);
    out.push_back({full_begin(j) + lo - j * len, lo, hi - lo});
  }
  return out;
}

bool has_sequence_parallel(const torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (auto* c = dynamic_cast<const ColumnParallelLinearImpl*>(m.get()); c && c->options.sequence_parallel()) return true;
    if (auto* r = dynamic_cast<const RowParallelLinearImpl*>(m.get()); r && r->options.sequence_parallel()) return true;
  }
  return false;
}

}  // namespace dtrain::tensor_parallel
