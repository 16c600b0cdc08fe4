#include "dtypes.h"

#include <c10/util/Exception.h>

namespace dtrain::checkpoint::detail {

namespace {
constexpr std::pair<Dtype, at::ScalarType> kPairs[] = {
    {Dtype::F64, at::kDouble}, {Dtype::F32, at::kFloat}, {Dtype::F16, at::kHalf}, {Dtype::BF16, at::kBFloat16},
    {Dtype::I64, at::kLong},   {Dtype::I32, at::kInt},   {Dtype::I16, at::kShort}, {Dtype::I8, at::kChar},
    {Dtype::U8, at::kByte},    {Dtype::BOOL, at::kBool},
};
}  // namespace

at::ScalarType to_scalar_type(Dtype dtype) {
  for (const auto& [d, t] : kPairs) {
    if (d == dtype) return t;
  }
  TORCH_CHECK(false, "checkpoint: invalid Dtype ", static_cast<int>(dtype));
}

std::optional<Dtype> from_scalar_type(at::ScalarType type) {
  for (const auto& [d, t] : kPairs) {
    if (t == type) return d;
  }
  return std::nullopt;
}

Dtype require_dtype(at::ScalarType type, const std::string& what) {
  auto d = from_scalar_type(type);
  TORCH_CHECK(d, what, ": dtype ", c10::toString(type),
              " cannot be stored in safetensors (supported: double, float, half, bfloat16, int64, int32, int16, "
              "int8, uint8, bool)");
  return *d;
}

}  // namespace dtrain::checkpoint::detail
