#include "whole_model.h"

#include <algorithm>
#include <unordered_set>

#include <ATen/ATen.h>

#include "dtrain/comm/all_reduce.h"

namespace dtrain::train::detail {

WholeModel::WholeModel(std::shared_ptr<torch::nn::Module> model, const std::vector<at::Tensor>& local,
                       const parallel::Groups& groups)
    : model_(std::move(model)), groups_(groups) {
  std::unordered_set<const void*> mine;
  for (const auto& p : local) mine.insert(p.unsafeGetTensorImpl());
  local_.assign(mine.begin(), mine.end());
  for (const auto& p : model_->parameters()) {
    if (!mine.count(p.unsafeGetTensorImpl())) others_.push_back({p, p.sizes().vec()});
  }
  release();
}

void WholeModel::materialize() {
  at::NoGradGuard no_grad;
  for (auto& [p, shape] : others_) {
    if (p.numel() == 0 && c10::multiply_integers(shape) > 0) p.set_data(at::zeros(shape, p.options()));
  }
}

void WholeModel::release() {
  at::NoGradGuard no_grad;
  for (auto& [p, shape] : others_) p.set_data(at::empty({0}, p.options()));
}

void WholeModel::gather() {
  materialize();
  const std::unordered_set<const void*> local(local_.begin(), local_.end());
  auto params = model_->parameters();
  const comm::ProcessGroup& world = groups_.world;
  // One replica of each stage (data rank 0) contributes; with tensor parallelism one all-reduce per
  // tensor rank, kept by that rank's ranks (their pieces).
  for (int r = 0; r < groups_.tensor.size() && !params.empty(); ++r) {
    const bool contributes = groups_.data.rank() == 0 && groups_.tensor.rank() == r;
    std::vector<at::Tensor> parts;
    for (const auto& p : params) {
      const bool mine = local.count(p.unsafeGetTensorImpl()) > 0;
      parts.push_back(mine && contributes ? p.detach().reshape({-1}).to(at::kFloat)
                                          : at::zeros({p.numel()}, p.options().dtype(at::kFloat)));
    }
    at::Tensor flat = at::cat(parts).to(world.device());
    comm::all_reduce(world, flat);  // x + 0 + ... + 0 = x: exact
    if (groups_.tensor.rank() != r) continue;
    flat = flat.to(at::kCPU);
    int64_t at = 0;
    at::NoGradGuard no_grad;
    for (auto& p : params) {
      p.detach().copy_(flat.narrow(0, at, p.numel()).view(p.sizes()));
      at += p.numel();
    }
  }
}

}  // namespace dtrain::train::detail
