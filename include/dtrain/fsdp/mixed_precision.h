#pragma once
// FSDP's mixed-precision policy (PyTorch's MixedPrecision / FSDP2's MixedPrecisionPolicy). The
// optimizer always steps fp32 master shards (the parameters' own dtype); unset fields mean "the
// parameters' dtype".
#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

namespace dtrain::fsdp {

struct MixedPrecision {
  // dtype of the gathered parameters, so of the forward and backward compute (e.g. kBFloat16).
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  // dtype gradients are reduced in (default: param_dtype).
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  // dtype buffers are cast to at construction.
  TORCH_ARG(std::optional<at::ScalarType>, buffer_dtype) = std::nullopt;
  // floating-point outputs of the root's forward are cast to this (e.g. kFloat for the loss).
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
};

}  // namespace dtrain::fsdp
