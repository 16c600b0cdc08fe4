#pragma once
// safetensors dtypes <-> libtorch scalar types.
#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include "dtrain/checkpoint/safetensors.h"

namespace dtrain::checkpoint::detail {

at::ScalarType to_scalar_type(Dtype dtype);
// nullopt for types safetensors cannot hold (complex, quantized, ...).
std::optional<Dtype> from_scalar_type(at::ScalarType type);
// from_scalar_type or a c10::Error "<what>: dtype X cannot be stored in safetensors (supported: ...)".
Dtype require_dtype(at::ScalarType type, const std::string& what);

}  // namespace dtrain::checkpoint::detail
