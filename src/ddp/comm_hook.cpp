// The bf16/fp16 reductions and hook (Design note [gradient compression], ddp/comm_hook.h).
#include "dtrain/ddp/comm_hook.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "dtrain/comm/all_gather.h"
#include "dtrain/comm/all_reduce.h"
#include "dtrain/comm/reduce_scatter.h"
#include "dtrain/comm/split.h"

namespace dtrain::ddp {

namespace {
void check_narrow(at::ScalarType dtype, const at::Tensor& t, const char* what) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, what, ": compresses to bf16 or fp16, not ", dtype);
  TORCH_CHECK(at::isFloatingType(t.scalar_type()) && t.element_size() > 2, what, ": the gradients are ",
              t.scalar_type(), ", already as narrow as the compression: leave it out");
}

// out = input / divisor in out's narrow dtype, one rounding (input.div(divisor).to(dtype)); on the
// CPU a slice at a time, where ATen's kernel would make an input-sized float32 temporary.
void divide_into(at::Tensor& out, const at::Tensor& input, int64_t divisor) {
  const at::Tensor flat = input.reshape({-1});
  if (!flat.is_cpu()) {
    out.copy_(flat.div(divisor));
    return;
  }
  constexpr int64_t kSlice = 64 * 1024;
  for (int64_t c = 0; c < flat.numel(); c += kSlice) {
    const int64_t len = std::min(kSlice, flat.numel() - c);
    out.narrow(0, c, len).copy_(flat.narrow(0, c, len).div(divisor));
  }
}

// `slot` as a flat tensor of `n` elements of `options`: kept from the last call where it fits, else
// made (and kept). Without buffers (nullptr slots), made each call.
at::Tensor kept(at::Tensor* slot, int64_t n, const at::TensorOptions& options) {
  if (!slot) return at::empty({n}, options);
  if (!slot->defined() || slot->numel() != n || slot->scalar_type() != options.dtype().toScalarType() ||
      slot->device() != options.device()) {
    *slot = at::empty({n}, options);
  }
  return *slot;
}

// This rank's part of the mean of `input` over the ranks, in `dtype`: each rank's input divided by
// W and cast (the fp16 range holds the parts; one rounding, as .div(W).to(dtype)),
// reduce-scattered with the sum in fp32 where the backend sums locally (Gloo; comm::reduce_scatter).
comm::Work start_narrow_reduce_scatter(const comm::ProcessGroup& pg, at::Tensor& part, const at::Tensor& input,
                                       const std::vector<int64_t>& counts, at::ScalarType dtype, NarrowBuffers* b) {
  at::NoGradGuard no_grad;
  const at::TensorOptions narrow_options = input.options().dtype(dtype);
  at::Tensor narrow = kept(b ? &b->narrow : nullptr, input.numel(), narrow_options);
  divide_into(narrow, input, pg.size());
  const int64_t mine = counts.at(static_cast<size_t>(pg.rank()));
  part = kept(b ? &b->part : nullptr, mine, narrow_options);
  comm::ReduceScatterOptions o = comm::ReduceScatterOptions().counts(counts).async_op(true);
  if (b && comm::reduce_scatter_uses_workspace(pg)) o.workspace(kept(&b->scatter_work, pg.size() * mine, narrow_options));
  return comm::reduce_scatter(pg, part, narrow, o);
}

// The all-gather of the parts into `gathered` (the workspace kept where the backend takes one).
comm::Work gather_parts(const comm::ProcessGroup& pg, at::Tensor& gathered, const at::Tensor& part,
                        const std::vector<int64_t>& counts, NarrowBuffers* b, bool async_op) {
  comm::AllGatherOptions o = comm::AllGatherOptions().counts(counts).async_op(async_op);
  if (b && comm::all_gather_uses_workspace(pg)) o.workspace(kept(&b->gather_work, pg.size() * part.numel(), part.options()));
  return comm::all_gather(pg, gathered, part, o);
}
}  // namespace

comm::Work compressed_all_reduce(const comm::ProcessGroup& pg, at::Tensor tensor, at::ScalarType dtype, NarrowBuffers* b) {
  check_narrow(dtype, tensor, "compressed_all_reduce");
  TORCH_CHECK(tensor.is_contiguous(), "compressed_all_reduce: the tensor must be contiguous");
  if (comm::reduces_natively(pg, dtype)) {  // one all-reduce in the narrow dtype (the design note)
    at::NoGradGuard no_grad;
    at::Tensor narrow = kept(b ? &b->narrow : nullptr, tensor.numel(), tensor.options().dtype(dtype));
    divide_into(narrow, tensor, pg.size());
    comm::Work w = comm::all_reduce(pg, narrow, comm::AllReduceOptions().async_op(true));
    return comm::Work::after(std::move(w), [tensor, narrow]() mutable {
      at::NoGradGuard no_grad;
      tensor.view({-1}).copy_(narrow);
    });
  }
  const std::vector<int64_t> counts = comm::even_split(tensor.numel(), pg.size());
  at::Tensor part;
  comm::Work first = start_narrow_reduce_scatter(pg, part, tensor, counts, dtype, b);
  at::Tensor gathered = kept(b ? &b->gathered : nullptr, tensor.numel(), part.options());
  return comm::Work::after(std::move(first), [pg, tensor, part, gathered, counts, b]() mutable {
    at::NoGradGuard no_grad;
    gather_parts(pg, gathered, part, counts, b, /*async_op=*/false).wait();
    tensor.view({-1}).copy_(gathered);
  });
}

comm::Work compressed_two_level_all_reduce(const comm::NodeGroups& nodes, at::Tensor tensor, at::ScalarType dtype,
                                           NarrowBuffers* b) {
  check_narrow(dtype, tensor, "compressed_two_level_all_reduce");
  TORCH_CHECK(nodes.two_level(), "compressed_two_level_all_reduce: the group is not split in two levels");
  TORCH_CHECK(tensor.is_contiguous(), "compressed_two_level_all_reduce: the tensor must be contiguous");
  const comm::ProcessGroup& within = nodes.within;
  const std::vector<int64_t> counts = comm::even_split(tensor.numel(), within.size());
  at::Tensor part;  // (the node's mean of this rank's part, in `dtype`: the sum of each input / L)
  comm::Work first = start_narrow_reduce_scatter(within, part, tensor, counts, dtype, b);
  // (stages, as the plain two-level all-reduce's: Design note [two-level all-reduce], comm/two_level.h)
  at::Tensor mean = kept(b ? &b->mean : nullptr, part.numel(), part.options().dtype(at::kFloat));
  at::Tensor gathered = kept(b ? &b->gathered : nullptr, tensor.numel(), part.options());
  NarrowBuffers* across = nullptr;  // (the across level's own buffers)
  if (b) {
    if (!b->across) b->across = std::make_shared<NarrowBuffers>();
    across = b->across.get();
  }
  std::vector<std::function<comm::Work()>> next;
  next.emplace_back([nodes, part, mean, across]() mutable {  // (across: the mean over the nodes of the nodes' means)
    at::NoGradGuard no_grad;
    mean.copy_(part);
    return compressed_all_reduce(nodes.across, mean, part.scalar_type(), across);
  });
  next.emplace_back([nodes, part, mean, gathered, counts, b]() mutable {
    at::NoGradGuard no_grad;
    part.copy_(mean);  // (exact: the mean came back in `dtype`'s values)
    return gather_parts(nodes.within, gathered, part, counts, b, /*async_op=*/true);
  });
  return comm::Work::staged(std::move(first), std::move(next), [tensor, gathered]() mutable {
    at::NoGradGuard no_grad;
    tensor.view({-1}).copy_(gathered);
  });
}

comm::Work compressed_reduce_scatter(const comm::ProcessGroup& pg, at::Tensor output, const at::Tensor& input,
                                     const std::vector<int64_t>& counts, at::ScalarType dtype, NarrowBuffers* b) {
  check_narrow(dtype, input, "compressed_reduce_scatter");
  TORCH_CHECK(output.numel() == counts.at(static_cast<size_t>(pg.rank())), "compressed_reduce_scatter: the output has ",
              output.numel(), " elements, this rank's part ", counts.at(static_cast<size_t>(pg.rank())));
  at::Tensor part;
  comm::Work first = start_narrow_reduce_scatter(pg, part, input, counts, dtype, b);
  return comm::Work::after(std::move(first), [output, part]() mutable {
    at::NoGradGuard no_grad;
    output.view({-1}).copy_(part);
  });
}

namespace {
class CastHook final : public CommHook {
 public:
  explicit CastHook(at::ScalarType dtype) : dtype_(dtype) {
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "cast_hook: bf16 or fp16, not ", dtype);
  }
  comm::Work reduce(const comm::ProcessGroup& pg, GradBucket& bucket) override {
    // (kept from step to step; by the bucket's own buffer too, so wrappers sharing this hook over
    // one group never share buffers)
    NarrowBuffers* b = &buffers_[{pg.name(), bucket.index, bucket.buffer.data_ptr()}];
    const auto split = nodes_.find(pg.name());  // (the split the reducer of this group offered)
    if (split != nodes_.end() && split->second.two_level()) {
      return compressed_two_level_all_reduce(split->second, bucket.buffer, dtype_, b);
    }
    return compressed_all_reduce(pg, bucket.buffer, dtype_, b);
  }
  bool use_nodes(const comm::ProcessGroup& pg, const comm::NodeGroups& nodes) override {
    nodes_[pg.name()] = nodes;
    return true;
  }
  std::string name() const override { return dtype_ == at::kBFloat16 ? "bf16" : "fp16"; }

 private:
  at::ScalarType dtype_;
  // (--hierarchical-all-reduce: each reducer's group split by node, by the group's name, for a hook
  // shared by several wrappers: Design note [gradient compression])
  std::map<std::string, comm::NodeGroups> nodes_;
  // Each bucket's narrow buffers, by group, bucket index and buffer (Design note [buffers reused],
  // util/block_pool.h: a steady step allocates none).
  std::map<std::tuple<std::string, size_t, const void*>, NarrowBuffers> buffers_;
};
}  // namespace

std::shared_ptr<CommHook> cast_hook(at::ScalarType dtype) { return std::make_shared<CastHook>(dtype); }

}  // namespace dtrain::ddp
