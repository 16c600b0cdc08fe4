#pragma once
// The one place where libtorch 1.13 and 2.x differ for dtrain.
//
// - 1.13: c10d::ProcessGroupGloo / ProcessGroupNCCL derive from c10d::ProcessGroup and are used
//   directly. 2.x: they derive from c10d::Backend (c10d::ProcessGroup became a dispatching
//   wrapper). dtrain talks to the backend object, so `compat::Backend` names that base class.
// - 1.13's Gloo lacks _allgather_base, _reduce_scatter_base and reduce_scatter: see
//   comm/all_gather.cpp and comm/reduce_scatter.cpp for how those are filled.
// - Autocast state: 1.13-2.3 have per-device functions (set_cpu_enabled, set_enabled for CUDA,
//   set_autocast_cpu_dtype, ...); 2.4+ take the device type. compat::autocast_* hide that.
// - Optimizer::zero_grad: 2.x frees the gradients by default (set_to_none = true), 1.13 zeroes them
//   in place. dtrain's strategies zero them in place on every version (compat::zero_grad_in_place),
//   so a step holds the same on both and the memory planner's prediction holds on both (with 2.x's
//   default, seen on 2.11: FSDP and recomputed runs held up to 12% less than predicted, DDP with gradient
//   accumulation 19% more: a fresh gradient beside its bucket).
// - Autograd nodes: std::shared_ptr<Node> (made with deleteNode as deleter, so a long graph is freed
//   without deep recursion) in releases before pytorch#181782 (merged 2026-04; 2.14 has it);
//   after it c10::intrusive_ptr<Node> (made with c10::make_intrusive). compat::NodePtr is whichever
//   torch::autograd::Edge holds, and compat::make_node builds a custom node the matching way.
// - TCPStore servers: 2.4+ have TCPStoreOptions::useLibUV, true by default, and a libtorch built
//   without libuv (Debian's 2.x) refuses it ("use_libuv was requested but PyTorch was built
//   without libuv support"). compat::make_tcp_store asks for libuv as PyTorch does (unless
//   USE_LIBUV=0, PyTorch's own switch) and falls back to the classic server where it is missing.
// - NCCL's watchdog switch: NCCL_ASYNC_ERROR_HANDLING up to 2.1, TORCH_NCCL_ASYNC_ERROR_HANDLING
//   from 2.2 (the old name is still read there, with a deprecation warning): kNcclAsyncErrorEnv.
// - Fused attention: at::scaled_dot_product_attention exists from 2.0 (flash / memory-efficient
//   kernels on CUDA, a fused CPU kernel in later 2.x); 1.13 has none. compat::kHaveSdpa and
//   compat::causal_attention (the math form on 1.13).
// - C++ standard: libtorch 2.14's headers need C++20 (1.13: 14, 2.6: 17). cmake/dtrainTorch.cmake
//   reads the standard off the torch target and compiles dtrain with it.
// - c10::Allocator: 2.3+ made allocate() non-const and added copy_data() (pure virtual);
//   DTRAIN_ALLOCATOR_CONST and DTRAIN_ALLOCATOR_HAS_COPY_DATA (util/memory.cpp's counting allocator).
// - Optimizer::state() is keyed by the parameter's TensorImpl: in 1.13 by the pointer's text
//   (c10::guts::to_string), in 2.x by the pointer itself: compat::optimizer_state_key.
// - at::_foreach_lerp_ exists from 2.0; compat::foreach_lerp_ lerps one tensor at a time on 1.13.
// - Profiler events: KinetoEvent::durationUs up to 2.0, durationNs after: compat::profiler_event_us.
// - fp16 on Gloo: 1.13's ProcessGroupGloo sums, gathers and sends Half (as gloo::float16). In 2.x it
//   handles Half and BF16 only where its Gloo was built with GLOO_USE_TORCH_DTYPES (pip's libtorch
//   is; Debian's 2.14, over the system libgloo, is not: "Invalid scalar type"), which a program cannot
//   see (pip ships no gloo headers). So on 2.x dtrain treats Half as BF16 on every build: moved as
//   bytes, summed in fp32 by dtrain (comm/detail.cpp gloo_supports): compat::kGlooHandlesHalf.

#include <torch/version.h>

#include <cstdlib>
#include <sstream>
#include <type_traits>
#include <vector>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/csrc/autograd/function.h>  // Node and Edge (2.14's edge.h alone does not compile)
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif
#include <ATen/autocast_mode.h>
#if TORCH_VERSION_MAJOR >= 2
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#endif

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define DTRAIN_ALLOCATOR_CONST
#define DTRAIN_ALLOCATOR_HAS_COPY_DATA 1
#else
#define DTRAIN_ALLOCATOR_CONST const
#define DTRAIN_ALLOCATOR_HAS_COPY_DATA 0
#endif

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
inline constexpr bool kTorch2 = true;
inline constexpr bool kGlooHandlesHalf = false;  // (see the top)
#else
using Backend = c10d::ProcessGroup;
inline constexpr bool kTorch2 = false;
inline constexpr bool kGlooHandlesHalf = true;
#endif

using Work = c10d::Work;

// optimizer.zero_grad() that zeroes the gradients in place on every version (see the top).
template <class Optimizer>
void zero_grad_in_place(Optimizer& optimizer) {
#if TORCH_VERSION_MAJOR >= 2
  optimizer.zero_grad(/*set_to_none=*/false);
#else
  optimizer.zero_grad();
#endif
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline void set_autocast_enabled(c10::DeviceType d, bool on) { at::autocast::set_autocast_enabled(d, on); }
inline at::ScalarType autocast_dtype(c10::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) { at::autocast::set_autocast_dtype(d, t); }
#else
inline bool autocast_enabled(c10::DeviceType d) {
  return d == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
inline void set_autocast_enabled(c10::DeviceType d, bool on) {
  if (d == c10::kCUDA) {
    at::autocast::set_enabled(on);
  } else {
    at::autocast::set_cpu_enabled(on);
  }
}
inline at::ScalarType autocast_dtype(c10::DeviceType d) {
  return d == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType d, at::ScalarType t) {
  if (d == c10::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(t);
  } else {
    at::autocast::set_autocast_cpu_dtype(t);
  }
}
#endif
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The owning pointer autograd uses for its graph nodes (see the header comment).
using NodePtr = decltype(std::declval<torch::autograd::Edge&>().function);
inline constexpr bool kSharedNodes = std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;

// A new custom autograd node of type T (derived from torch::autograd::Node), owned the way this
// libtorch owns nodes. The deleter call is unqualified on purpose: it is found by argument-dependent
// lookup in torch::autograd only when the shared_ptr branch is instantiated, so the intrusive
// branch compiles against a libtorch that no longer has deleteNode.
template <class T, class... Args>
auto make_node(Args&&... args) {
  if constexpr (kSharedNodes) {
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](auto* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

namespace detail {
// Sets opts.useLibUV where the field exists (2.4+); returns whether it does.
template <class Options>
auto set_use_libuv(Options& opts, bool on, int) -> decltype(opts.useLibUV = on, bool()) {
  opts.useLibUV = on;
  return true;
}
template <class Options>
bool set_use_libuv(Options&, bool, long) {
  return false;
}
}  // namespace detail

// A TCPStore (server or client) with `opts`; see the header comment for the libuv choice.
inline c10::intrusive_ptr<c10d::TCPStore> make_tcp_store(const std::string& host, c10d::TCPStoreOptions opts) {
  const char* env = std::getenv("USE_LIBUV");
  const bool libuv = !(env && std::string(env) == "0");
  if (!detail::set_use_libuv(opts, libuv, 0) || !libuv) {
    return c10::make_intrusive<c10d::TCPStore>(host, opts);
  }
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("libuv") == std::string::npos) throw;
    detail::set_use_libuv(opts, false, 0);  // this libtorch has no libuv: the classic server
    return c10::make_intrusive<c10d::TCPStore>(host, opts);
  }
}

// Causal attention softmax(q k^T / sqrt(D) + causal mask) v over q, k, v [B, H, T, D], with dropout
// p on the attention weights, by at::scaled_dot_product_attention. Only where kHaveSdpa.
#if TORCH_VERSION_MAJOR >= 2
inline constexpr bool kHaveSdpa = true;
inline at::Tensor sdpa_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double p) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);
}
#else
inline constexpr bool kHaveSdpa = false;
inline at::Tensor sdpa_causal(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "scaled_dot_product_attention needs libtorch 2.0 or later; this is ", TORCH_VERSION);
}
#endif

// at::_foreach_lerp_(self, end, weight) (2.0+); on 1.13 the same lerp_ one tensor at a time.
inline void foreach_lerp_(std::vector<at::Tensor>& self, const std::vector<at::Tensor>& end, double weight) {
#if TORCH_VERSION_MAJOR >= 2
  at::_foreach_lerp_(self, end, weight);
#else
  for (size_t i = 0; i < self.size(); ++i) self[i].lerp_(end[i], weight);
#endif
}

// The key of parameter `p` in an optimizer's state map of type Map (Optimizer::state()'s).
template <class Map>
typename Map::key_type optimizer_state_key(const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << static_cast<const void*>(p.unsafeGetTensorImpl());
    return os.str();
  } else {
    return Key(p.unsafeGetTensorImpl());
  }
}

// A profiler event's duration in microseconds: KinetoEvent::durationUs up to 2.0, durationNs after
// (the overload taking int is chosen where durationNs exists; call with 0).
template <class Event>
auto profiler_event_us(const Event& e, int) -> decltype(static_cast<double>(e.durationNs()) / 1000.0) {
  return static_cast<double>(e.durationNs()) / 1000.0;
}
template <class Event>
double profiler_event_us(const Event& e, long) {
  return static_cast<double>(e.durationUs());
}

// The environment variable that turns NCCL's asynchronous error handling on in this libtorch.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
inline constexpr const char* kNcclAsyncErrorEnv = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
#else
inline constexpr const char* kNcclAsyncErrorEnv = "NCCL_ASYNC_ERROR_HANDLING";
#endif

}  // namespace dtrain::compat
