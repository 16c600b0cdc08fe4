#pragma once
// Whole tensors of what a run wrote, for comparing runs: an exported safetensors file, a committed
// checkpoint's model/ and optim/ tensors, and their comparison within a tolerance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/checkpoint/safetensors.h"
#include "dtrain/checkpoint/store.h"

namespace dtrain::testing::resume {


using Tensors = std::map<std::string, at::Tensor>;

// A plain safetensors file (what --export-weights writes), read back through the checkpoint
// library's header parser (which validates every field).
inline Tensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const dtrain::checkpoint::SafetensorsHeader header = dtrain::checkpoint::parse_safetensors_prefix(bytes, bytes.size(), path);
  Tensors out;
  for (const auto& e : header.entries) {
    const at::ScalarType type = e.dtype == dtrain::checkpoint::Dtype::F32 ? at::kFloat : e.dtype == dtrain::checkpoint::Dtype::I64 ? at::kLong
                                                                                                    : at::kByte;
    EXPECT_TRUE(e.dtype == dtrain::checkpoint::Dtype::F32 || e.dtype == dtrain::checkpoint::Dtype::I64) << path << ": " << e.name << " is "
                                                                        << dtrain::checkpoint::dtype_name(e.dtype);
    at::Tensor t = at::empty(e.shape, type);
    EXPECT_EQ(static_cast<uint64_t>(t.numel() * t.element_size()), e.end - e.begin) << e.name;
    std::memcpy(t.data_ptr(), bytes.data() + header.buffer_offset + e.begin, e.end - e.begin);
    out[e.name] = t;
  }
  return out;
}

// The model/ and optim/ tensors of a committed checkpoint, whole.
inline Tensors checkpoint_tensors(const std::string& dir) {
  const dtrain::checkpoint::Reader reader = dtrain::checkpoint::Reader::open(dir);
  Tensors out;
  for (const auto& key : reader.keys()) {
    if (key.rfind("model/", 0) == 0 || key.rfind("optim/", 0) == 0) out[key] = reader.read(key);
  }
  return out;
}

inline std::vector<std::string> names(const Tensors& t) {
  std::vector<std::string> out;
  for (const auto& kv : t) out.push_back(kv.first);
  return out;
}

// What a key holds, for tolerances: "model", "optim/<field>" (a field of every parameter), or
// "weights" (an exported file's plain names).
inline std::string kind_of(const std::string& key) {
  if (key.rfind("model/", 0) == 0) return "model";
  if (key.rfind("optim/", 0) == 0) return "optim/" + key.substr(key.rfind('/') + 1);
  return "weights";
}

// Same names, shapes and dtypes. tol 0: every tensor bit for bit. Else integer tensors (e.g.
// optim/<p>/step) exactly, and per kind (the model, each optimizer field) the relative 2-norm
// error ||got - want|| / ||want|| over all its tensors at most tol: runs at other world sizes
// differ by the reduction order, which AdamW's normalised update turns into absolute differences
// of ~1e-6 even where a parameter's gradient is (mathematically) zero, so an element-wise relative
// bound would not hold; one tensor left unloaded or stale still moves the norm by far more than tol.
inline void expect_same_tensors(const Tensors& got, const Tensors& want, double tol, const std::string& what) {
  ASSERT_FALSE(want.empty()) << what;
  EXPECT_EQ(names(got), names(want)) << what;
  struct Norms {
    double diff_sq = 0, want_sq = 0, worst = 0;
    std::string worst_name;
  };
  std::map<std::string, Norms> by_kind;
  for (const auto& [name, w] : want) {
    const auto it = got.find(name);
    if (it == got.end()) continue;
    const at::Tensor& g = it->second;
    ASSERT_EQ(g.sizes(), w.sizes()) << what << ": " << name;
    ASSERT_EQ(g.scalar_type(), w.scalar_type()) << what << ": " << name;
    if (tol == 0 || !w.is_floating_point()) {
      EXPECT_TRUE(at::equal(g, w)) << what << ": " << name << " differs";
      continue;
    }
    const at::Tensor d = g.to(at::kDouble) - w.to(at::kDouble);
    Norms& n = by_kind[kind_of(name)];
    n.diff_sq += d.pow(2).sum().item<double>();
    n.want_sq += w.to(at::kDouble).pow(2).sum().item<double>();
    const double worst = d.abs().max().item<double>();
    if (worst >= n.worst) n = Norms{n.diff_sq, n.want_sq, worst, name};
  }
  for (const auto& [kind, n] : by_kind) {
    const double rel = std::sqrt(n.diff_sq) / std::max(std::sqrt(n.want_sq), 1e-30);
    EXPECT_LE(rel, tol) << what << ": " << kind << " relative error " << rel << " (largest difference " << n.worst
                        << " in " << n.worst_name << ")";
  }
}

}  // namespace dtrain::testing::resume
