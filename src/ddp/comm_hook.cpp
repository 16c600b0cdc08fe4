// The bf16/fp16 reductions and hook (Design note [gradient compression], ddp/comm_hook.h).
#include "dtrain/ddp/comm_hook.h"

#include <map>
#include <string>

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

// This rank's part of the mean of `input` over the ranks, in `dtype`: each rank's input divided by
// W and cast (the fp16 range holds the parts), reduce-scattered with the sum in fp32 where the
// backend sums locally (Gloo; comm::reduce_scatter).
comm::Work start_narrow_reduce_scatter(const comm::ProcessGroup& pg, at::Tensor& part, const at::Tensor& input,
                                       const std::vector<int64_t>& counts, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  const at::Tensor narrow = input.reshape({-1}).div(pg.size()).to(dtype);
  part = at::empty({counts.at(static_cast<size_t>(pg.rank()))}, narrow.options());
  return comm::reduce_scatter(pg, part, narrow, comm::ReduceScatterOptions().counts(counts).async_op(true));
}
}  // namespace

comm::Work compressed_all_reduce(const comm::ProcessGroup& pg, at::Tensor tensor, at::ScalarType dtype) {
  check_narrow(dtype, tensor, "compressed_all_reduce");
  TORCH_CHECK(tensor.is_contiguous(), "compressed_all_reduce: the tensor must be contiguous");
  if (comm::reduces_natively(pg, dtype)) {  // one all-reduce in the narrow dtype (the design note)
    at::NoGradGuard no_grad;
    at::Tensor narrow = tensor.div(pg.size()).to(dtype);
    comm::Work w = comm::all_reduce(pg, narrow, comm::AllReduceOptions().async_op(true));
    return comm::Work::after(std::move(w), [tensor, narrow]() mutable {
      at::NoGradGuard no_grad;
      tensor.copy_(narrow);
    });
  }
  const std::vector<int64_t> counts = comm::even_split(tensor.numel(), pg.size());
  at::Tensor part;
  comm::Work first = start_narrow_reduce_scatter(pg, part, tensor, counts, dtype);
  return comm::Work::after(std::move(first), [pg, tensor, part, counts]() mutable {
    at::NoGradGuard no_grad;
    at::Tensor gathered = at::empty({tensor.numel()}, part.options());
    comm::all_gather(pg, gathered, part, comm::AllGatherOptions().counts(counts)).wait();
    tensor.view({-1}).copy_(gathered);
  });
}

comm::Work compressed_two_level_all_reduce(const comm::NodeGroups& nodes, at::Tensor tensor, at::ScalarType dtype) {
  check_narrow(dtype, tensor, "compressed_two_level_all_reduce");
  TORCH_CHECK(nodes.two_level(), "compressed_two_level_all_reduce: the group is not split in two levels");
  TORCH_CHECK(tensor.is_contiguous(), "compressed_two_level_all_reduce: the tensor must be contiguous");
  const comm::ProcessGroup& within = nodes.within;
  const std::vector<int64_t> counts = comm::even_split(tensor.numel(), within.size());
  at::Tensor part;  // (the node's mean of this rank's part, in `dtype`: the sum of each input / L)
  comm::Work first = start_narrow_reduce_scatter(within, part, tensor, counts, dtype);
  // (stages, as the plain two-level all-reduce's: Design note [two-level all-reduce], comm/two_level.h)
  at::Tensor mean = at::empty({part.numel()}, part.options().dtype(at::kFloat));
  at::Tensor gathered = at::empty({tensor.numel()}, part.options());
  std::vector<std::function<comm::Work()>> next;
  next.emplace_back([nodes, part, mean]() mutable {  // (across: the mean over the nodes of the nodes' means)
    at::NoGradGuard no_grad;
    mean.copy_(part);
    return compressed_all_reduce(nodes.across, mean, part.scalar_type());
  });
  next.emplace_back([nodes, part, mean, gathered, counts]() mutable {
    at::NoGradGuard no_grad;
    part.copy_(mean);  // (exact: the mean came back in `dtype`'s values)
    return comm::all_gather(nodes.within, gathered, part, comm::AllGatherOptions().counts(counts).async_op(true));
  });
  return comm::Work::staged(std::move(first), std::move(next), [tensor, gathered]() mutable {
    at::NoGradGuard no_grad;
    tensor.view({-1}).copy_(gathered);
  });
}

comm::Work compressed_reduce_scatter(const comm::ProcessGroup& pg, at::Tensor output, const at::Tensor& input,
                                     const std::vector<int64_t>& counts, at::ScalarType dtype) {
  check_narrow(dtype, input, "compressed_reduce_scatter");
  TORCH_CHECK(output.numel() == counts.at(static_cast<size_t>(pg.rank())), "compressed_reduce_scatter: the output has ",
              output.numel(), " elements, this rank's part ", counts.at(static_cast<size_t>(pg.rank())));
  at::Tensor part;
  comm::Work first = start_narrow_reduce_scatter(pg, part, input, counts, dtype);
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
    const auto split = nodes_.find(pg.name());  // (the split the reducer of this group offered)
    if (split != nodes_.end() && split->second.two_level()) {
      return compressed_two_level_all_reduce(split->second, bucket.buffer, dtype_);
    }
    return compressed_all_reduce(pg, bucket.buffer, dtype_);
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
};
}  // namespace

std::shared_ptr<CommHook> cast_hook(at::ScalarType dtype) { return std::make_shared<CastHook>(dtype); }

}  // namespace dtrain::ddp
