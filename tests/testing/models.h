#pragma once
// Small models shared by the data-parallel and optimizer tests, built deterministically (the
// default generator is process-wide, so construction is serialised for rank threads).
#include <cstdint>
#include <mutex>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

namespace dtrain::testing {

inline std::mutex& init_mutex() {
  static std::mutex mu;
  return mu;
}

// Three layers, a frozen parameter, a buffer counting forwards, and an optional side branch used
// only when forward is asked to (for unused-parameter tests).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(bool with_side) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 4));
    if (with_side) side = register_module("side", torch::nn::Linear(8, 4));
    frozen = register_parameter("frozen", at::ones({4}), /*requires_grad=*/false);
    steps = register_buffer("steps", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x, bool use_side = false) {
    steps.add_(1);
    auto y = fc3(at::tanh(fc2(at::tanh(fc1(x))))) * frozen;
    return use_side ? y + side(x) : y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, side{nullptr};
  at::Tensor frozen, steps;
};
TORCH_MODULE(Net);

inline Net make_net(uint64_t seed, bool with_side) {
  std::lock_guard<std::mutex> lock(init_mutex());
  torch::manual_seed(seed);
  return Net(with_side);
}

// 6 -> 40 -> 24 -> 3 with tanh.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(6, 40));
    b = register_module("b", torch::nn::Linear(40, 24));
    c = register_module("c", torch::nn::Linear(24, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return c(at::tanh(b(at::tanh(a(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Mlp);

inline Mlp make_mlp(uint64_t seed) {
  std::lock_guard<std::mutex> lock(init_mutex());
  torch::manual_seed(seed);
  return Mlp();
}

// max |a - b| / max |b|
inline double max_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

}  // namespace dtrain::testing
