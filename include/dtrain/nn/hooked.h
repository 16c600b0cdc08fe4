#pragma once
// Forward hooks for modules that know nothing of dtrain: stock layers (torch::nn::Linear, Conv2d,
// ...) and a user's own modules, so that they can be FSDP units or recomputed regions without a
// change to their code and without renaming a parameter.
//
// Design note [hooked modules]
// ----------------------------
// A C++ parent calls a child's forward either statically (`fc1->forward(x)` on a holder member,
// `list[i]->as<Block>()->forward(x)`) or through torch::nn::AnyModule (how Sequential calls its
// children). Only the second can be redirected from outside. So:
//  - HookedImpl<M> derives from M and from Hookable and redeclares M's forward with the same
//    signature, running it through forward_hooks() (Design note [forward hooks]). It registers
//    nothing of its own, so every parameter keeps the name it has in M. Copy-constructing one from
//    an M shares M's tensors and children (a Module copy holds the same TensorImpls), which is
//    what FSDP's set_data-based gathering needs.
//  - The children of a torch::nn::Sequential are upgraded in place: make_hookable() replaces the
//    child with a HookedImpl copy both in the Sequential's AnyModule list (which its forward runs)
//    and in its registered children (which named_parameters walks), under the same key. The model's
//    code does not change; `seq[i]` is then a HookedImpl<T>, which is-a T (`seq->at<T>(i)`, which
//    checks the exact type, no longer matches).
//  - A holder member or a ModuleList element called through its static type cannot be redirected:
//    its declaration says so instead, `dtrain::nn::Hooked<torch::nn::Linear> fc1{nullptr};`
//    constructed as `fc1 = register_module("fc1", decltype(fc1)(in, out));`. Same names, same forward.
// Which types make_hookable can upgrade: those registered with register_hookable<T>() (the stock
// layers below are registered from the start).
//
// Tensor arguments of forward (at::Tensor by value or const reference) are what hooks see and may
// replace (recomputation re-runs the body on detached copies); other arguments are copied and passed
// as given, at the forward and again at a replay, so they must own their data: a forward taking a
// view (ArrayRef, string_view) or tensors inside another type (optional<Tensor>, vector<Tensor>)
// does not compile as a HookedImpl. forward may return at::Tensor, std::tuple of at::Tensor, or
// std::vector<at::Tensor>.
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include "dtrain/nn/forward_hooks.h"

namespace dtrain::nn {

namespace detail {

template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

// Outputs <-> Tensors for the return types hooks support.
template <class R>
struct Outputs {
  static_assert(sizeof(R) == 0,
                "dtrain::nn::HookedImpl: forward must return at::Tensor, std::tuple<at::Tensor...> or "
                "std::vector<at::Tensor>");
};
template <>
struct Outputs<at::Tensor> {
  static Tensors flatten(const at::Tensor& t) { return {t}; }
  static at::Tensor rebuild(Tensors&& ts) { return std::move(ts.at(0)); }
};
template <>
struct Outputs<std::vector<at::Tensor>> {
  static Tensors flatten(const std::vector<at::Tensor>& ts) { return ts; }
  static std::vector<at::Tensor> rebuild(Tensors&& ts) { return std::move(ts); }
};
template <class... T>
struct Outputs<std::tuple<T...>> {
  static_assert((is_tensor_v<T> && ...), "dtrain::nn::HookedImpl: a tuple output must hold tensors only");
  static Tensors flatten(const std::tuple<T...>& t) {
    return std::apply([](const auto&... x) { return Tensors{x...}; }, t);
  }
  static std::tuple<T...> rebuild(Tensors&& ts) { return rebuild(std::move(ts), std::index_sequence_for<T...>{}); }
  template <size_t... I>
  static std::tuple<T...> rebuild(Tensors&& ts, std::index_sequence<I...>) {
    return std::tuple<T...>(std::move(ts.at(I))...);
  }
};

// Position of argument I among the tensor arguments.
template <size_t I, class... A>
constexpr size_t tensor_index() {
  constexpr bool flags[] = {is_tensor_v<A>..., false};
  size_t n = 0;
  for (size_t k = 0; k < I; ++k) n += flags[k] ? 1 : 0;
  return n;
}

// Arguments the replay cannot keep safely: views (their data may be gone when recomputation
// replays the body in backward) and containers of tensors (their gradients would be lost: only
// plain tensor arguments are hook inputs).
template <class T>
struct UnsafeArg : std::false_type {};
template <class T>
struct UnsafeArg<c10::ArrayRef<T>> : std::true_type {};
template <class T>
struct UnsafeArg<c10::optional<T>> : UnsafeArg<T> {};
template <>
struct UnsafeArg<c10::optional<at::Tensor>> : std::true_type {};
template <>
struct UnsafeArg<std::vector<at::Tensor>> : std::true_type {};
template <>
struct UnsafeArg<c10::string_view> : std::true_type {};

template <class Sig>
struct ForwardOf;
template <class R, class C, class... A>
struct ForwardOf<R (C::*)(A...)> {
  using Return = R;
  using Args = std::tuple<A...>;
};

}  // namespace detail

template <class M, class Sig = decltype(&M::forward)>
class HookedImpl;

// M with its forward run through forward_hooks(); see the design note.
template <class M, class R, class C, class... A>
class HookedImpl<M, R (C::*)(A...)> : public M, public Hookable {
  static_assert(!(detail::UnsafeArg<std::decay_t<A>>::value || ...),
                "dtrain::nn::HookedImpl: forward takes a view (ArrayRef, string_view) or a container of tensors "
                "(optional<Tensor>, vector<Tensor>), which recomputation cannot replay safely; give the module "
                "plain at::Tensor and owning arguments, or make it derive from dtrain::nn::Hookable");

 public:
  using Contained = M;
  using M::M;
  // A copy of `m` that shares its parameters, buffers and children. Stock layers derive from
  // torch::nn::Module virtually (through Cloneable), so M's copy constructor does not copy the
  // Module part (a virtual base is built by the most-derived class): copy it explicitly.
  explicit HookedImpl(const M& m) : M(m) {
    static_cast<torch::nn::Module&>(*this) = static_cast<const torch::nn::Module&>(m);
  }

  R forward(A... args) {
    if (forward_hooks().size() == 0) return M::forward(std::forward<A>(args)...);
    // The body may run again after this call returns (recomputation replays it in backward): it
    // keeps its own copy of the arguments.
    auto saved = std::make_shared<const std::tuple<std::decay_t<A>...>>(args...);
    Tensors inputs;
    collect(*saved, inputs, std::index_sequence_for<A...>{});
    Tensors out = forward_hooks().run(inputs, [this, saved](const Tensors& in) {
      return detail::Outputs<R>::flatten(call(*saved, in, std::index_sequence_for<A...>{}));
    });
    return detail::Outputs<R>::rebuild(std::move(out));
  }

  // M::clone gives an M: make it a HookedImpl again (Sequential's clone needs the exact type).
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<c10::Device>& device = c10::nullopt) const override {
    auto copy = std::dynamic_pointer_cast<M>(M::clone(device));
    TORCH_CHECK(copy, "HookedImpl::clone: the clone of ", this->name(), " is not a ", this->name());
    return std::make_shared<HookedImpl>(*copy);
  }

 private:
  template <class Tuple, size_t... I>
  static void collect(const Tuple& all, Tensors& out, std::index_sequence<I...>) {
    (
        [&] {
          if constexpr (detail::is_tensor_v<std::tuple_element_t<I, std::tuple<A...>>>) out.push_back(std::get<I>(all));
        }(),
        ...);
  }
  template <size_t I, class Tuple>
  static decltype(auto) arg(const Tuple& all, const Tensors& in) {
    using T = std::tuple_element_t<I, std::tuple<A...>>;
    if constexpr (detail::is_tensor_v<T>) {
      return static_cast<const at::Tensor&>(in.at(detail::tensor_index<I, A...>()));
    } else {
      return std::get<I>(all);
    }
  }
  template <class Tuple, size_t... I>
  R call(const Tuple& all, const Tensors& in, std::index_sequence<I...>) {
    return M::forward(arg<I>(all, in)...);
  }
};

// The holder of HookedImpl<H::Impl>: declare a member `dtrain::nn::Hooked<torch::nn::Linear> fc{nullptr};`
// and construct it with the layer's own arguments, `fc = register_module("fc", decltype(fc)(3, 4));`.
template <class Holder>
class Hooked : public torch::nn::ModuleHolder<HookedImpl<typename Holder::ContainedType>> {
 public:
  using Base = torch::nn::ModuleHolder<HookedImpl<typename Holder::ContainedType>>;
  using Base::Base;
};

// Makes `T` upgradable by make_hookable (stock layers are registered already).
template <class T>
void register_hookable();

// The module to put hooks on for `child`, the child registered under `key` in `parent`: `child`
// itself when it is Hookable; a HookedImpl copy swapped into `parent` when `parent` is a
// torch::nn::Sequential and the child's type is registered (see the design note); otherwise an
// error naming `path` and what to change. The returned module is owned by `parent`.
torch::nn::Module& make_hookable(torch::nn::Module& parent, const std::string& key, torch::nn::Module& child,
                                 const std::string& path);
// Whether make_hookable can give `child` hooks in some parent (Hookable, or of a registered type).
bool can_be_hooked(const torch::nn::Module& child);
// Whether make_hookable(parent, ..., child) would succeed.
bool can_hook_in(const torch::nn::Module& parent, const torch::nn::Module& child);

namespace detail {
// A HookedImpl copy of the module, as an AnyModule (which must be built from the static type).
using Upgrade = std::function<torch::nn::AnyModule(torch::nn::Module&)>;
void register_upgrade(std::type_index type, Upgrade upgrade);
}  // namespace detail

template <class T>
void register_hookable() {
  detail::register_upgrade(typeid(T), [](torch::nn::Module& m) {
    return torch::nn::AnyModule(std::make_shared<HookedImpl<T>>(dynamic_cast<T&>(m)));
  });
}

}  // namespace dtrain::nn
