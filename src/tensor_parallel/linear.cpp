#include "dtrain/tensor_parallel/linear.h"

#include <mutex>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/nn/hooked.h"
#include "dtrain/tensor_parallel/regions.h"

namespace dtrain::tensor_parallel {

namespace {
void check_divides(int64_t features, const char* which, const char* layer, const comm::ProcessGroup& tp) {
  if (features % tp.size() != 0) {
    throw std::invalid_argument(std::string(layer) + ": " + which + " " + std::to_string(features) +
                                " does not divide by the tensor-parallel degree " + std::to_string(tp.size()) +
                                " (rank " + std::to_string(tp.rank()) + "); pick a --tp that divides it");
  }
}

// The full weight and bias as torch::nn::Linear(in, out) draws them (same generator calls).
std::pair<at::Tensor, at::Tensor> full_init(const ParallelLinearOptions& o) {
  torch::nn::Linear full(torch::nn::LinearOptions(o.in_features(), o.out_features()).bias(o.bias()));
  return {full->weight.detach(), o.bias() ? full->bias.detach() : at::Tensor()};
}
}  // namespace

namespace {
// In a torch::nn::Sequential the layers become FSDP units and recomputed modules in place, as
// torch::nn::Linear does (Design note [hooked modules], nn/hooked.h).
void register_for_hooks() {
  static std::once_flag once;
  std::call_once(once, [] {
    nn::register_hookable<ColumnParallelLinearImpl>();
    nn::register_hookable<RowParallelLinearImpl>();
  });
}
}  // namespace

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ParallelLinearOptions o, comm::ProcessGroup tp)
    : options(std::move(o)), tp_(std::move(tp)) {
  register_for_hooks();
  TORCH_CHECK(options.stride() >= 1 && options.out_features() % options.stride() == 0, "ColumnParallelLinear: stride ",
              options.stride(), " must divide out_features ", options.out_features());
  check_divides(options.out_features() / options.stride(), options.stride() == 1 ? "out_features" : "out_features / stride",
                "ColumnParallelLinear", tp_);
  reset();
}

void ColumnParallelLinearImpl::reset() {
  auto [w, b] = full_init(options);
  weight = register_parameter("weight", rows_piece(w, tp_, options.stride()).contiguous());
  if (options.bias()) bias = register_parameter("bias", rows_piece(b, tp_, options.stride()).contiguous());
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor in = options.sequence_parallel() ? gather_sequence(x, tp_, options.sequence_dim())
                                                    : copy_to_region(x, tp_);
  at::Tensor y = at::linear(in, weight, bias);
  return options.gather_output() ? gather_from_region(y, tp_, -1) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(ParallelLinearOptions o, comm::ProcessGroup tp)
    : options(std::move(o)), tp_(std::move(tp)) {
  register_for_hooks();
  check_divides(options.in_features(), "in_features", "RowParallelLinear", tp_);
  reset();
}

void RowParallelLinearImpl::reset() {
  auto [w, b] = full_init(options);
  weight = register_parameter("weight", slice_along(w, tp_, 1));
  if (options.bias()) bias = register_parameter("bias", b.clone());
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  const at::Tensor in = options.input_is_parallel() ? x : scatter_to_region(x, tp_, -1);
  const at::Tensor partial = at::linear(in, weight);
  at::Tensor y = options.sequence_parallel() ? reduce_scatter_sequence(partial, tp_, options.sequence_dim())
                                             : reduce_from_region(partial, tp_);
  if (!bias.defined()) return y;
  // Sequence parallel: this rank adds the bias to its part of the sequence only, so its gradient
  // is partial; copy_to_region's backward sums it over the group (Megatron all-reduces such
  // "sequence-parallel" gradients after backward).
  return y + (options.sequence_parallel() ? copy_to_region(bias, tp_) : bias);
}

}  // namespace dtrain::tensor_parallel
