#include "dtrain/nn/hooked.h"

// Design note [hooked modules] (dtrain/nn/hooked.h).
#include <mutex>
#include <unordered_map>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace dtrain::nn {

namespace {

// The types make_hookable can upgrade (a type registry, like libtorch's own: written by
// register_hookable, read by make_hookable; never holds module state).
class Upgrades {
 public:
  static Upgrades& get() {
    static Upgrades u;
    return u;
  }
  void add(std::type_index t, detail::Upgrade f) {
    std::lock_guard<std::mutex> lock(mu_);
    map_[t] = std::move(f);
  }
  detail::Upgrade find(std::type_index t) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(t);
    return it == map_.end() ? detail::Upgrade() : it->second;
  }

 private:
  Upgrades() = default;
  std::mutex mu_;
  std::unordered_map<std::type_index, detail::Upgrade> map_;
};

template <class... T>
void register_all() {
  (register_hookable<T>(), ...);
}

void register_stock_layers() {
  static std::once_flag once;
  std::call_once(once, [] {
    using namespace torch::nn;
    // BatchNorm*: libtorch 1.13 does not export BatchNormImplBase<>::pretty_print, which a
    // derived class needs at link time; register it in a program that links fine against yours.
    // ConvTranspose*: forward takes an optional IntArrayRef (a view), which a replay cannot keep.
    register_all<LinearImpl, BilinearImpl, Conv1dImpl, Conv2dImpl, Conv3dImpl, EmbeddingImpl, LayerNormImpl,
                 GroupNormImpl, DropoutImpl>();
  });
}

}  // namespace

namespace detail {
void register_upgrade(std::type_index type, Upgrade upgrade) { Upgrades::get().add(type, std::move(upgrade)); }
}  // namespace detail

bool can_be_hooked(const torch::nn::Module& child) {
  if (dynamic_cast<const Hookable*>(&child)) return true;
  register_stock_layers();
  return static_cast<bool>(Upgrades::get().find(typeid(child)));
}

bool can_hook_in(const torch::nn::Module& parent, const torch::nn::Module& child) {
  if (dynamic_cast<const Hookable*>(&child)) return true;
  return dynamic_cast<const torch::nn::SequentialImpl*>(&parent) != nullptr && can_be_hooked(child);
}

torch::nn::Module& make_hookable(torch::nn::Module& parent, const std::string& key, torch::nn::Module& child,
                                 const std::string& path) {
  if (dynamic_cast<Hookable*>(&child)) return child;
  register_stock_layers();
  const std::string what = path + " (" + child.name() + ")";
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&parent);
  auto upgrade = Upgrades::get().find(typeid(child));
  TORCH_CHECK(seq, what, " is a child of ", parent.name(), ", which calls its forward directly, so nothing can run "
              "before and after that forward. Declare it as dtrain::nn::Hooked<...> where the member is declared "
              "(e.g. `dtrain::nn::Hooked<torch::nn::Linear> fc{nullptr};`, built with `fc = register_module(\"fc\", "
              "decltype(fc)(in, out));`: same parameter names), make its class derive from dtrain::nn::Hookable, "
              "or hold it in a torch::nn::Sequential (Design note [hooked modules], dtrain/nn/hooked.h)");
  TORCH_CHECK(upgrade, what, " is in a torch::nn::Sequential but its type is not registered for hooks: call "
              "dtrain::nn::register_hookable<", child.name(), ">() first, or make it derive from "
              "dtrain::nn::Hookable (Design note [hooked modules], dtrain/nn/hooked.h)");
  // The child's position in the Sequential: the position of `key` among its children (a Sequential
  // registers entry i as child i; the same module may sit at several positions).
  const auto children = seq->named_children();
  size_t index = 0;
  for (const auto& item : children) {
    if (item.key() == key) break;
    ++index;
  }
  TORCH_CHECK(index < seq->size() && seq->ptr(index).get() == &child, what, ": not the entry ", key,
              " of its torch::nn::Sequential");
  {
    auto it = seq->begin() + static_cast<std::ptrdiff_t>(index);
    torch::nn::AnyModule any = upgrade(child);
    std::shared_ptr<torch::nn::Module> hooked = any.ptr();
    *it = std::move(any);  // what the Sequential's forward runs
    seq->replace_module(key, hooked);  // what named_parameters() walks: same key, same order
    return *hooked;
  }
  TORCH_CHECK(false, what, ": not found among the entries of its torch::nn::Sequential (", key, ")");
}

}  // namespace dtrain::nn
