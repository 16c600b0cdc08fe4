#include "dtrain/optim/clip_grad.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/all_reduce.h"
#include "dtrain/optim/sharded_optimizer.h"

namespace dtrain::optim {


double clip_grad_norm(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& params, double max_norm,
                      double norm_type, bool error_if_nonfinite) {
  return clip_grad_norm(pg, params, params, max_norm, norm_type, error_if_nonfinite);
}

double clip_grad_norm(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& counted,
                      const std::vector<at::Tensor>& scaled, double max_norm, double norm_type,
                      bool error_if_nonfinite) {
  std::vector<at::Tensor> counted_grads, scaled_grads;
  for (const auto& p : counted) {
    if (p.grad().defined()) counted_grads.push_back(p.grad());
  }
  for (const auto& p : scaled) {
    if (p.grad().defined()) scaled_grads.push_back(p.grad());
  }
  return clip_grads(pg, counted_grads, scaled_grads, max_norm, norm_type, error_if_nonfinite);
}

double clip_grads(const comm::ProcessGroup& pg, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& scaled, double max_norm, double norm_type, bool error_if_nonfinite) {
  TORCH_CHECK(pg.is_member(), "clip_grad_norm: this rank is not a member of the process group");
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  TORCH_CHECK(inf || (std::isfinite(norm_type) && norm_type >= 0), pg.describe(),
              " clip_grad_norm: norm_type must be a p >= 0 or +infinity, got ", norm_type);
  // This rank's part, in double on the group's device: sum of |g|_p^p over its gradients (p > 0),
  // their number (p = 0), or the largest |g| (inf).
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(pg.device());
  at::Tensor part = at::zeros({1}, opts);
  {
    at::NoGradGuard no_grad;
    if (norm_type == 0) {
      part.fill_(static_cast<double>(grads.size()));
    } else if (!grads.empty()) {
      std::vector<at::Tensor> norms;
      norms.reserve(grads.size());
      for (const auto& g : grads) {
        if (inf) {
          if (g.numel() > 0) norms.push_back(g.detach().abs().max().to(opts));
        } else {
          norms.push_back(g.detach().norm(norm_type).to(opts));
        }
      }
      if (!norms.empty()) {
        at::Tensor all = at::stack(norms);
        part = (inf ? all.max() : all.pow(norm_type).sum()).reshape({1});
      }
    }
  }
  comm::all_reduce(pg, part, comm::AllReduceOptions().op(inf ? comm::ReduceOp::Max : comm::ReduceOp::Sum));
  double total = part.item<double>();
  if (!inf && norm_type != 0) total = std::pow(total, 1.0 / norm_type);
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(total), pg.describe(), " clip_grad_norm: the global ", norm_type,
              "-norm of the gradients is ", total, ", so they cannot be clipped; find the non-finite gradient, "
              "or pass error_if_nonfinite = false to scale them anyway");
  // As clip_grad_norm_: max_norm / (norm + 1e-6), at most 1 (a NaN norm makes every gradient NaN).
  const double coef = max_norm / (total + 1e-6);
  if (!(coef >= 1.0)) {
    at::NoGradGuard no_grad;
    for (const auto& g : scaled) g.mul_(coef);
  }
  return total;
}

double clip_grad_norm(const comm::ProcessGroup& pg, const ShardedOptimizer& opt, double max_norm, double norm_type,
                      bool error_if_nonfinite) {
  TORCH_CHECK(pg.is_member(), "clip_grad_norm: this rank is not a member of the process group");
  const auto& partition = opt.partition();
  TORCH_CHECK(static_cast<int>(partition.by_rank.size()) == pg.size(), pg.describe(),
              " clip_grad_norm: the optimizer partitions its parameters over ", partition.by_rank.size(),
              " rank(s) but the process group has ", pg.size(), "; pass the group the optimizer was built over");
  std::vector<at::Tensor> owned;
  for (size_t i : partition.by_rank[pg.rank()]) owned.push_back(opt.params()[i]);
  return clip_grad_norm(pg, owned, max_norm, norm_type, error_if_nonfinite);
}

double clip_grad_norm(const ShardedOptimizer& opt, double max_norm, double norm_type, bool error_if_nonfinite) {
  return clip_grad_norm(opt.process_group(), opt, max_norm, norm_type, error_if_nonfinite);
}

}  // namespace dtrain::optim
