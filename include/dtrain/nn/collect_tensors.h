#pragma once
// The tensors inside a forward's output (a tensor, a vector of them, or tuples/pairs of those), in
// order: what DDP and FSDP hang their backward hooks on, whatever the wrapped module returns.
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::nn {

inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect_tensors(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out);
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out);

template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... x) { (collect_tensors(x, out), ...); }, t);
}

}  // namespace dtrain::nn
