#pragma once
// Command line of dtrain-gpt.
#include <cstdint>
#include <string>
#include <vector>

namespace gpt_demo {

struct Options {
  std::string strategy = "ddp";  // single | ddp | zero1 | zero2 | fsdp | hsdp
  int64_t layers = 4;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t seq_len = 128;
  int64_t batch_size = 8;  // per rank, per micro-batch
  int64_t grad_accum = 1;
  int64_t steps = 100;
  double lr = 1e-3;
  uint64_t seed = 0;
  std::string optimizer = "adamw";  // adamw | sgd
  int threads = 0;                  // 0: cores / local ranks
  std::string data;                 // empty: /usr/share/common-licenses
  std::string metrics;              // JSON-lines file (rank 0)
  double bucket_cap_mb = 25.0;
  double clip_grad_norm = 0.0;  // 0: no clipping
  bool activation_checkpointing = false;
  std::string precision = "fp32";  // fp32 | bf16 (autocast) | fp16 (autocast, CUDA only)
  std::string device = "cpu";      // cpu | cuda (cuda:LOCAL_RANK); see device.h
  std::string backend = "auto";    // auto (gloo for cpu, nccl for cuda) | gloo | nccl
  std::string loss_scale;          // none | dynamic (default: dynamic for fp16, none otherwise)
  int64_t loss_scale_growth_interval = 2000;  // dynamic: good steps before the scale doubles
  bool cpu_offload = false;        // fsdp/hsdp: shards and optimizer on the CPU (no-op for --device cpu)
  std::string sharding;          // fsdp/hsdp: full | grad_op | none | hybrid (default full / hybrid)
  std::string wrap = "block";    // fsdp/hsdp units: block (one per transformer block) | none
  int shard_size = 0;            // hybrid: ranks per shard group (0: LOCAL_WORLD_SIZE)
  bool init_on_ranks = false;    // fsdp/hsdp: build without values, initialise shard by shard
  std::string backward_prefetch;  // fsdp/hsdp: before | after | none (default before), fsdp::BackwardPrefetch
  std::string overlap_reduction;  // fsdp/hsdp: on | off (default on), FullyShardedOptions::overlap_reduction
  int max_gathered_units = 0;     // fsdp/hsdp: nested units gathered at once by prefetch (0: FSDP's default)
  std::string save;        // checkpoint root (empty: no checkpoints); see checkpointing.h
  int64_t save_every = 0;  // save every N steps (0: only after the last step)
  std::string resume;      // checkpoint root (or directory) to resume from, if it has one
  std::string attention = "fused";  // fused (scaled_dot_product_attention where libtorch has it) | math
  double peak_tflops = 0;  // the device's peak for the mfu metric (0: known GPUs by name, else no mfu)
  std::string export_weights;  // after the last step: the weights as one safetensors file (empty: none)
};

// Throws std::invalid_argument with a message naming the flag.
Options parse_options(const std::vector<std::string>& args);
std::string usage();

}  // namespace gpt_demo
