// PowerSGD (ddp/powersgd.h): the per-bucket state and the two phases of a compressed reduction.
#include "dtrain/ddp/powersgd.h"

#include <algorithm>
#include <cfloat>
#include <map>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/all_reduce.h"

namespace dtrain::ddp {

namespace {

// Gram-Schmidt over the columns of `m` (k x r), in place; a zero column stays zero.
void orthogonalize(at::Tensor m) {
  const int64_t r = m.size(1);
  for (int64_t i = 0; i < r; ++i) {
    at::Tensor col = m.narrow(1, i, 1);
    col.div_(col.norm().clamp_min(FLT_MIN));
    if (i + 1 < r) {
      at::Tensor rest = m.narrow(1, i + 1, r - i - 1);
      rest.sub_((col * rest).sum(0, /*keepdim=*/true) * col);
    }
  }
}

// One compressed gradient of a bucket: M (n x m, a view of the bucket) and its factors' places.
struct Factor {
  at::Tensor m;
  int64_t rank = 0;
  int64_t p_offset = 0, q_offset = 0;  // in the flat all-reduced P (after the plain gradients) and Q

  at::Tensor p_in(const at::Tensor& flat) const { return flat.narrow(0, p_offset, m.size(0) * rank).view({m.size(0), rank}); }
  at::Tensor q_in(const at::Tensor& flat) const { return flat.narrow(0, q_offset, m.size(1) * rank).view({m.size(1), rank}); }
};

struct PowerBucket {
  at::Tensor error;  // flat as the bucket (error feedback)
  at::Tensor q;      // flat, every Q of the bucket (warm start)
};

class PowerSGDHook final : public CommHook {
 public:
  explicit PowerSGDHook(PowerSGDOptions o) : o_(o) {
    TORCH_CHECK(o_.rank() >= 1, "PowerSGD: the rank must be at least 1, got ", o_.rank());
    TORCH_CHECK(o_.warmup_steps() >= 0, "PowerSGD: warmup_steps must be >= 0, got ", o_.warmup_steps());
  }

  comm::Work reduce(const comm::ProcessGroup& pg, GradBucket& bucket) override {
    const bool compress = step_ >= o_.warmup_steps();
    if (bucket.last) ++step_;  // (every bucket of a step decided first)
    if (!compress) return plain_mean(pg, bucket.buffer);
    at::NoGradGuard no_grad;
    PowerBucket& st = buckets_[bucket.index];
    at::Tensor before;  // the bucket with last step's error, for this step's error
    if (o_.error_feedback()) {
      if (st.error.defined() && st.error.numel() == bucket.buffer.numel()) {
        bucket.buffer.add_(st.error.to(bucket.buffer.options()));  // (a resumed state is on the CPU)
      }
      before = bucket.buffer.clone();
    }
    std::vector<Factor> factors;
    std::vector<at::Tensor> plain;
    int64_t p_total = 0, q_total = 0, u_total = 0;
    for (const at::Tensor& g : bucket.grads) {
      const int64_t n = g.dim() > 1 ? g.size(0) : 0, m = n > 0 ? g.numel() / n : 0;
      const int64_t r = std::min({o_.rank(), n, m});
      if (n > 0 && static_cast<double>((n + m) * r) * o_.min_compression_rate() < static_cast<double>(n * m)) {
        factors.push_back({g.view({n, m}), r, p_total, q_total});
        p_total += n * r;
        q_total += m * r;
      } else {
        plain.push_back(g);
        u_total += g.numel();
      }
    }
    for (Factor& f : factors) f.p_offset += u_total;  // (P after the plain gradients)
    // One all-reduce carries the uncompressed gradients and every P.
    at::Tensor first = at::empty({u_total + p_total}, bucket.buffer.options());
    int64_t at = 0;
    for (const at::Tensor& g : plain) {
      first.narrow(0, at, g.numel()).copy_(g.reshape({-1}));
      at += g.numel();
    }
    at::Tensor q = factors_q(st, bucket.index, factors, q_total, bucket.buffer.options());
    for (const Factor& f : factors) {
      at::Tensor p = f.p_in(first);
      at::matmul_out(p, f.m, f.q_in(q));
    }
    comm::Work work = comm::all_reduce(pg, first, comm::AllReduceOptions().async_op(true));
    const double inv_world = 1.0 / pg.size();
    return comm::Work::after(std::move(work), [this, pg, inv_world, first, q, plain, factors, before,
                                               buffer = bucket.buffer, index = bucket.index]() mutable {
      at::NoGradGuard no_grad;
      int64_t at = 0;
      for (at::Tensor& g : plain) {
        g.copy_(first.narrow(0, at, g.numel()).view(g.sizes()).mul_(inv_world));
        at += g.numel();
      }
      for (const Factor& f : factors) {  // Q = M^T orthogonalize(P), averaged over the ranks
        at::Tensor p = f.p_in(first), qf = f.q_in(q);
        orthogonalize(p);
        at::matmul_out(qf, f.m.t(), p);
      }
      if (q.numel() > 0) comm::all_reduce(pg, q).wait();
      q.mul_(inv_world);
      // An inf or NaN gradient (an fp16 loss scale that overflowed) would stay in the warm-started
      // Q and the error for good: Q is the same on every rank, so all start it over alike; the
      // error is this rank's own.
      const bool q_finite = q.numel() == 0 || at::isfinite(q).all().item<bool>();
      if (!q_finite) buckets_[index].q = at::Tensor();
      for (Factor& f : factors) {  // M ~ P Q^T
        at::matmul_out(f.m, f.p_in(first), f.q_in(q).t());
      }
      if (o_.error_feedback()) {
        at::Tensor error = before - buffer;
        buckets_[index].error = q_finite && at::isfinite(error).all().item<bool>() ? error : at::Tensor();
      }
    });
  }

  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    out.emplace_back("step", at::scalar_tensor(step_, at::kLong).reshape({1}));
    for (const auto& [b, st] : buckets_) {
      const std::string prefix = "bucket" + std::to_string(b) + "/";
      if (st.error.defined()) out.emplace_back(prefix + "error", st.error);
      if (st.q.defined()) out.emplace_back(prefix + "q", st.q);
    }
    return out;
  }

  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& state) override {
    reset_state();
    for (const auto& [name, t] : state) {
      if (name == "step") {
        step_ = t.reshape({-1})[0].item<int64_t>();
        continue;
      }
      const size_t slash = name.find('/');
      TORCH_CHECK(name.rfind("bucket", 0) == 0 && slash != std::string::npos, "PowerSGD: unknown state \"", name, "\"");
      PowerBucket& st = buckets_[std::stoul(name.substr(6, slash - 6))];
      const std::string field = name.substr(slash + 1);
      TORCH_CHECK(field == "error" || field == "q", "PowerSGD: unknown state \"", name, "\"");
      (field == "error" ? st.error : st.q) = t.clone();
    }
  }

  void reset_state() override {
    buckets_.clear();
    step_ = 0;
  }

  std::string name() const override { return "powersgd:" + std::to_string(o_.rank()); }

 private:
  // The initial mean of a bucket's gradients (the warm-up), as DDP's own reduction.
  static comm::Work plain_mean(const comm::ProcessGroup& pg, at::Tensor buffer) {
    comm::Work w = comm::all_reduce(pg, buffer, comm::AllReduceOptions().async_op(true));
    const double inv_world = 1.0 / pg.size();
    return comm::Work::after(std::move(w), [buffer, inv_world]() mutable { buffer.mul_(inv_world); });
  }

  // The bucket's Qs: last step's (warm start), or random (seed + bucket; drawn on the CPU so every
  // rank and device gets the same) and orthogonalized.
  at::Tensor factors_q(PowerBucket& st, size_t index, const std::vector<Factor>& factors, int64_t total,
                       const at::TensorOptions& options) {
    if (o_.warm_start() && st.q.defined() && st.q.numel() == total) {
      if (st.q.device() != options.device() || st.q.dtype() != options.dtype()) st.q = st.q.to(options);  // (resumed)
      return st.q;
    }
    // (without warm start a new draw every step, as PyTorch's: the step in the seed)
    at::Generator gen = at::detail::createCPUGenerator(o_.seed() + index + (o_.warm_start() ? 0 : 1000003 * static_cast<uint64_t>(step_)));
    at::Tensor q = at::randn({total}, gen, options.device(at::kCPU)).to(options.device());
    for (const Factor& f : factors) orthogonalize(f.q_in(q));
    st.q = q;
    return q;
  }

  PowerSGDOptions o_;
  int64_t step_ = 0;  // reductions so far (steps with a synchronised backward)
  std::map<size_t, PowerBucket> buckets_;
};

}  // namespace

std::shared_ptr<CommHook> powersgd_hook(PowerSGDOptions options) { return std::make_shared<PowerSGDHook>(options); }

}  // namespace dtrain::ddp
