#pragma once
// Where and in what precision dtrain-gpt computes: --device, --backend, --precision. Header-only
// (tests/examples/gpt_device_test.cpp checks every case on a machine without a GPU).
//
// The device is one value: main.cpp resolves it once (resolve_device), builds the process group
// for it (backend_for), moves the model (place_model) and every batch there and opens the autocast
// region of its type; the strategies take it from the model's parameters (DDP's buckets, ZeRO's
// shards and FSDP's flat parameters are allocated like the parameters) and the collectives from
// the process group. Nothing else asks whether it is CUDA.
//
// Design note [fp32 reduction]: with --precision bf16 or fp16, FSDP gathers the parameters and
// computes in that dtype but reduces the gradients in fp32 (MixedPrecision::reduce_dtype). fp16:
// the loss scale pushes gradients toward fp16's largest value (65504), so a sum over W ranks could
// overflow where the average would not, and each addition keeps only 11 significant bits; bf16
// keeps 8. The price is twice the bytes of a 16-bit reduce-scatter, and the master shards and the
// optimizer are fp32 anyway. PyTorch's FSDP documentation recommends the same for fp16. DDP and
// ZeRO keep fp32 parameters (autocast casts per op), so their gradients are fp32 already.
#include <cstdint>
#include <stdexcept>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "options.h"

namespace gpt_demo {

// --device for the rank `rank` whose LOCAL_RANK is `local_rank`, when this process sees
// `cuda_devices` CUDA devices (torch::cuda::device_count()): the CPU, or cuda:<local_rank> (the
// device an NCCL group of dtrain puts this rank's collectives on). Throws std::invalid_argument
// "rank R: --device cuda but ..." when that device does not exist.
inline c10::Device resolve_device(const std::string& device, int rank, int local_rank, int64_t cuda_devices) {
  if (device == "cpu") return c10::Device(c10::kCPU);
  if (device != "cuda") throw std::invalid_argument("--device must be cpu or cuda, got '" + device + "'");
  const std::string who = "rank " + std::to_string(rank) + ": --device cuda but ";
  if (cuda_devices <= 0) {
    throw std::invalid_argument(who + "this process sees no CUDA device (this libtorch is built without CUDA, or no "
                                      "GPU is visible: check the driver and CUDA_VISIBLE_DEVICES); use --device cpu");
  }
  if (local_rank < 0 || local_rank >= cuda_devices) {
    throw std::invalid_argument(who + "its LOCAL_RANK " + std::to_string(local_rank) + " has no GPU: this machine has " +
                                std::to_string(cuda_devices) + " CUDA device(s), one per local rank; start at most " +
                                std::to_string(cuda_devices) + " rank(s) per node (dtrun --nproc-per-node)");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

// The process-group backend: --backend, where "auto" means gloo for --device cpu and nccl for cuda.
inline std::string backend_for(const Options& o) {
  if (o.backend != "auto") return o.backend;
  return o.device == "cuda" ? "nccl" : "gloo";
}

// The dtype of the forward's autocast region and of FSDP's gathered parameters.
inline at::ScalarType compute_dtype(const Options& o) {
  if (o.precision == "bf16") return at::kBFloat16;
  if (o.precision == "fp16") return at::kHalf;
  return at::kFloat;
}

// Moves the model's parameters and buffers to `device`. A model built with deferred values
// (--init-on-ranks: every parameter a zero-stride placeholder, GPTOptions::defer_init) gets
// placeholders on `device` instead, so nothing is allocated there before FSDP materialises its
// shards (a plain to() would allocate every full parameter).
inline void place_model(torch::nn::Module& model, const c10::Device& device, bool deferred) {
  if (!deferred) {
    model.to(device);
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) p.set_data(at::zeros({}, p.options().device(device)).expand(p.sizes()));
  for (auto& b : model.buffers()) b.set_data(b.to(device));
}

}  // namespace gpt_demo
