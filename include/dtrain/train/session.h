#pragma once
// Where a run trains: the process group and the one device of this rank, from a TrainConfig.
//
// The device is one value: start() resolves it once (resolve_device), builds the process group for
// it (backend_for); the program moves the model (place_model) and every batch there and fit() opens
// the autocast region of its type; the strategies take it from the model's parameters (DDP's
// buckets, ZeRO's shards and FSDP's flat parameters are allocated like the parameters) and the
// collectives from the process group. Nothing else asks whether it is CUDA.
//
// Design note [fp32 reduction]: with --precision bf16 or fp16, FSDP gathers the parameters and
// computes in that dtype but reduces the gradients in fp32 (MixedPrecision::reduce_dtype). fp16:
// the loss scale pushes gradients toward fp16's largest value (65504), so a sum over W ranks could
// overflow where the average would not, and each addition keeps only 11 significant bits; bf16
// keeps 8. The price is twice the bytes of a 16-bit reduce-scatter, and the master shards and the
// optimizer are fp32 anyway. PyTorch's FSDP documentation recommends the same for fp16. DDP and
// ZeRO keep fp32 parameters (autocast casts per op), so their gradients are fp32 already.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "dtrain/comm/init.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/train/config.h"
#include "dtrain/train/elastic.h"

namespace dtrain::train {

struct Session {
  comm::LaunchInfo launch;
  c10::Device device = c10::Device(c10::kCPU);
  comm::ProcessGroup pg;
  // --elastic: the membership and vote of in-process recovery (train/elastic.h); pg is its group.
  std::shared_ptr<Elastic> elastic;
};

// Resolves the device of this rank, creates the process group for it (env://: dtrun, torchrun,
// srun) and sets the intra-op threads (cfg.threads, or cores / local ranks). With --elastic the
// group is generation 0's, or for a process dtrun started to join a running job
// (DTRAIN_ELASTIC_JOIN=<id>) the generation that takes it in.
Session start(const TrainConfig& cfg);

// cfg.device for the rank `rank` whose LOCAL_RANK is `local_rank`, when this process sees
// `cuda_devices` CUDA devices: the CPU, or cuda:<local_rank>. Over `backend` "gloo" more local
// ranks than GPUs share them (cuda:<local_rank mod cuda_devices>; Design note [ranks sharing a
// GPU]); otherwise throws std::invalid_argument "rank R: --device cuda but ..." when that device
// does not exist.
c10::Device resolve_device(const std::string& device, const std::string& backend, int rank, int local_rank,
                           int64_t cuda_devices);
// The process-group backend: cfg.backend, where "auto" means gloo for --device cpu and nccl for cuda.
std::string backend_for(const TrainConfig& cfg);
// Moves the model's parameters and buffers to `device`. A model built with deferred values
// (--init-on-ranks: every parameter a zero-stride placeholder) gets placeholders on `device`
// instead, so nothing is allocated there before FSDP materialises its shards.
void place_model(torch::nn::Module& model, const c10::Device& device, bool deferred);

// For main(): runs `body` and returns its exit code; an exception becomes one line on stderr,
// "<program> [rank R]: error: <message>" (no backtrace), and exit code 1, so dtrun reports the
// message and the rank instead of a signal.
int run_reporting_errors(const std::string& program, const std::function<int()>& body);

}  // namespace dtrain::train
