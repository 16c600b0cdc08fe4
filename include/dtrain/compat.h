#pragma once
// The one place where libtorch 1.13 and 2.x differ for dtrain.
//
// - 1.13: c10d::ProcessGroupGloo / ProcessGroupNCCL derive from c10d::ProcessGroup and are used
//   directly. 2.x: they derive from c10d::Backend (c10d::ProcessGroup became a dispatching
//   wrapper). dtrain talks to the backend object, so `compat::Backend` names that base class.
// - 1.13's Gloo lacks _allgather_base, _reduce_scatter_base and reduce_scatter: see
//   comm/all_gather.cpp and comm/reduce_scatter.cpp for how those are filled.
// - Optimizer::zero_grad's default changed (set_to_none = true in 2.x): dtrain never relies on it.

#include <torch/version.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
inline constexpr bool kTorch2 = true;
#else
using Backend = c10d::ProcessGroup;
inline constexpr bool kTorch2 = false;
#endif

using Work = c10d::Work;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

}  // namespace dtrain::compat
