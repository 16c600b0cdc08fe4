#include "dtrain/tensor_parallel/plan.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/tensor_parallel/linear.h"
#include "dtrain/tensor_parallel/regions.h"
#include "dtrain/tensor_parallel/vocab.h"

namespace dtrain::tensor_parallel {

Plan Plan::of(const torch::nn::Module& model, comm::ProcessGroup tp) {
  Plan plan;
  plan.tp_ = std::move(tp);
  for (const auto& item : model.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    const torch::nn::Module* m = item.value().get();
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

}  // namespace dtrain::tensor_parallel
