#include "options.h"

#include <functional>
#include <map>
#include <stdexcept>

#include "dtrain/util/parse.h"

namespace gpt_demo {

namespace {
int64_t to_int(const std::string& flag, const std::string& v, int64_t lo) {
  auto x = dtrain::util::parse_int(v);
  if (!x || *x < lo) {
    throw std::invalid_argument(flag + " expects an integer >= " + std::to_string(lo) + ", got '" + v + "'");
  }
  return *x;
}
double to_double(const std::string& flag, const std::string& v) {
  auto x = dtrain::util::parse_double(v);
  if (!x || !(*x > 0)) throw std::invalid_argument(flag + " expects a positive number, got '" + v + "'");
  return *x;
}
// `v` when it is one of `choices`; else throws "<flag> must be a, b or c, got 'v'".
std::string one_of(const std::string& flag, const std::string& v, const std::vector<std::string>& choices) {
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == v) return v;
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  }
  throw std::invalid_argument(flag + " must be " + list + ", got '" + v + "'");
}
}  // namespace

std::string usage() {
  return R"(usage: dtrain-gpt [options]      (run under dtrun for several ranks)
Trains a byte-level GPT on real text, in one process or data-parallel (DDP, ZeRO, FSDP).
  --strategy S              how to train (default ddp):
                              single  one process
                              ddp     DistributedDataParallel (gradients all-reduced)
                              zero1   DDP + optimizer state sharded across ranks (ZeRO-1)
                              zero2   gradients reduce-scattered to their owners + sharded
                                      optimizer state (ZeRO-2)
                              fsdp    FullyShardedDataParallel (ZeRO-3): parameters, gradients
                                      and optimizer state sharded (--sharding, default full)
                              hsdp    FSDP with hybrid sharding: sharded within a node,
                                      replicated across nodes (= fsdp --sharding hybrid)
  --sharding full|grad_op|none|hybrid   fsdp/hsdp sharding strategy
  --wrap block|none         fsdp/hsdp units: one per transformer block (default) or one in all
  --shard-size N            hybrid: ranks per shard group (default: ranks per node)
  --init-on-ranks           fsdp/hsdp: build the model without values and initialise it one
                            parameter at a time into the shards (no rank holds the whole model)
  --backward-prefetch before|after|none   fsdp/hsdp: when backward gathers the next unit (before)
  --overlap-reduction on|off  fsdp/hsdp: a unit's gradient reduction overlaps the next unit's
                            backward (on); off with --backward-prefetch after: the memory-lean
                            backward, one unit's parameters and gradients at a time (docs/fsdp.md)
  --max-gathered-units N    fsdp/hsdp: nested units gathered at once by prefetching (2)
  --layers N --d-model N --heads N --seq-len N     model shape (4, 128, 4, 128)
  --attention fused|math    fused: scaled_dot_product_attention where libtorch has it (2.x; flash
                            kernels on CUDA), math: softmax(q k^T) v by hand (1.13 always) (fused)
  --batch-size N            sequences per rank per micro-batch (8)
  --grad-accum N            micro-batches per step (1); no gradient sync until the last
  --steps N                 optimizer steps (100)
  --lr X                    learning rate (1e-3)
  --optimizer adamw|sgd     AdamW (weight decay 0.01) or SGD with momentum 0.9 (adamw)
  --seed N                  model init and data order (0)
  --threads N               intra-op threads per rank (default: cores / local ranks)
  --data PATH               text file or directory (default /usr/share/common-licenses)
  --metrics FILE            JSON lines: one per step, then a final summary (rank 0 writes); with
                            --device cuda also peak_gpu_mib, and mfu where the peak is known
  --peak-tflops X           the device's peak TFLOP/s for the mfu metric (default: known GPUs'
                            dense bf16/fp16 peak by name; none on the CPU unless given)
  --bucket-cap-mb X         gradient bucket size for ddp/zero1/zero2 (25)
  --clip-grad-norm X        clip gradients to this global 2-norm (default: no clipping)
  --activation-checkpointing  recompute each block's activations in backward (less memory)
  --device cpu|cuda         where to train (cpu); cuda: each rank on cuda:LOCAL_RANK (one GPU per
                            local rank), with the model, batches and every strategy there
  --backend auto|gloo|nccl  process-group backend (auto: gloo for --device cpu, nccl for cuda)
  --precision fp32|bf16|fp16  bf16: forward and loss under an autocast region (CPU or CUDA; fp32
                            master weights; fsdp/hsdp gather bf16 parameters and reduce in fp32);
                            fp16: the same in fp16, --device cuda only, with dynamic loss scaling
  --loss-scale none|dynamic   dynamic: scale the loss, unscale the gradients each rank holds before
                            clipping, skip a step (on every rank) whose gradients have inf/NaN and
                            halve the scale; default dynamic for fp16, none otherwise
  --loss-scale-growth-interval N   dynamic: double the scale after N steps without inf/NaN (2000)
  --cpu-offload             fsdp/hsdp: master shards, gradients and optimizer state on the CPU
                            (the optimizer steps there); for --device cuda: with --device cpu
                            it changes nothing
  --save DIR                write training checkpoints under DIR (after the last step, and every
                            --save-every N steps); atomic, sharded, resumable at any world size
  --save-every N            save every N steps (default: only at the end)
  --resume DIR              continue from DIR's latest checkpoint up to --steps (total); starts from
                            step 0 when DIR has none yet, so one command line works with restarts
  --export-weights PATH     after the last step, write the trained weights as one plain
                            safetensors file (for inference; fsdp/hsdp stream it unit by unit)
The global batch (ranks x batch-size x grad-accum) at step t is the same set of samples for
any number of ranks, so runs with equal global batches are comparable.
)";
}

Options parse_options(const std::vector<std::string>& args) {
  Options o;
  bool growth_interval_given = false;
  std::map<std::string, std::function<void(const std::string&)>> with_value = {
      {"--strategy", [&](const std::string& v) {
         if (v != "single" && v != "ddp" && v != "zero1" && v != "zero2" && v != "fsdp" && v != "hsdp") {
           throw std::invalid_argument("--strategy must be single, ddp, zero1, zero2, fsdp or hsdp, got '" + v + "'");
         }
         o.strategy = v;
       }},
      {"--layers", [&](const std::string& v) { o.layers = to_int("--layers", v, 1); }},
      {"--d-model", [&](const std::string& v) { o.d_model = to_int("--d-model", v, 1); }},
      {"--heads", [&](const std::string& v) { o.heads = to_int("--heads", v, 1); }},
      {"--seq-len", [&](const std::string& v) { o.seq_len = to_int("--seq-len", v, 1); }},
      {"--batch-size", [&](const std::string& v) { o.batch_size = to_int("--batch-size", v, 1); }},
      {"--grad-accum", [&](const std::string& v) { o.grad_accum = to_int("--grad-accum", v, 1); }},
      {"--steps", [&](const std::string& v) { o.steps = to_int("--steps", v, 1); }},
      {"--lr", [&](const std::string& v) { o.lr = to_double("--lr", v); }},
      {"--seed", [&](const std::string& v) { o.seed = static_cast<uint64_t>(to_int("--seed", v, 0)); }},
      {"--optimizer", [&](const std::string& v) {
         if (v != "adamw" && v != "sgd") throw std::invalid_argument("--optimizer must be adamw or sgd, got '" + v + "'");
         o.optimizer = v;
       }},
      {"--threads", [&](const std::string& v) { o.threads = static_cast<int>(to_int("--threads", v, 1)); }},
      {"--data", [&](const std::string& v) { o.data = v; }},
      {"--metrics", [&](const std::string& v) { o.metrics = v; }},
      {"--attention", [&](const std::string& v) { o.attention = one_of("--attention", v, {"fused", "math"}); }},
      {"--peak-tflops", [&](const std::string& v) { o.peak_tflops = to_double("--peak-tflops", v); }},
      {"--bucket-cap-mb", [&](const std::string& v) { o.bucket_cap_mb = to_double("--bucket-cap-mb", v); }},
      {"--clip-grad-norm", [&](const std::string& v) { o.clip_grad_norm = to_double("--clip-grad-norm", v); }},
      {"--sharding", [&](const std::string& v) {
         if (v != "full" && v != "grad_op" && v != "none" && v != "hybrid") {
           throw std::invalid_argument("--sharding must be full, grad_op, none or hybrid, got '" + v + "'");
         }
         o.sharding = v;
       }},
      {"--wrap", [&](const std::string& v) {
         if (v != "block" && v != "none") throw std::invalid_argument("--wrap must be block or none, got '" + v + "'");
         o.wrap = v;
       }},
      {"--shard-size", [&](const std::string& v) { o.shard_size = static_cast<int>(to_int("--shard-size", v, 1)); }},
      {"--backward-prefetch", [&](const std::string& v) {
         if (v != "before" && v != "after" && v != "none") {
           throw std::invalid_argument("--backward-prefetch must be before, after or none, got '" + v + "'");
         }
         o.backward_prefetch = v;
       }},
      {"--overlap-reduction", [&](const std::string& v) {
         if (v != "on" && v != "off") throw std::invalid_argument("--overlap-reduction must be on or off, got '" + v + "'");
         o.overlap_reduction = v;
       }},
      {"--max-gathered-units", [&](const std::string& v) {
         o.max_gathered_units = static_cast<int>(to_int("--max-gathered-units", v, 1));
       }},
      {"--save", [&](const std::string& v) { o.save = v; }},
      {"--save-every", [&](const std::string& v) { o.save_every = to_int("--save-every", v, 1); }},
      {"--resume", [&](const std::string& v) { o.resume = v; }},
      {"--export-weights", [&](const std::string& v) {
         if (v.empty()) throw std::invalid_argument("--export-weights needs a file name");
         o.export_weights = v;
       }},
      {"--precision", [&](const std::string& v) { o.precision = one_of("--precision", v, {"fp32", "bf16", "fp16"}); }},
      {"--device", [&](const std::string& v) { o.device = one_of("--device", v, {"cpu", "cuda"}); }},
      {"--backend", [&](const std::string& v) { o.backend = one_of("--backend", v, {"auto", "gloo", "nccl"}); }},
      {"--loss-scale", [&](const std::string& v) { o.loss_scale = one_of("--loss-scale", v, {"none", "dynamic"}); }},
      {"--loss-scale-growth-interval", [&](const std::string& v) {
         o.loss_scale_growth_interval = to_int("--loss-scale-growth-interval", v, 1);
         growth_interval_given = true;
       }},
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::string value;
    bool inline_value = false;
    if (auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      inline_value = true;
    }
    if (flag == "--activation-checkpointing") {
      o.activation_checkpointing = true;
      continue;
    }
    if (flag == "--init-on-ranks") {
      o.init_on_ranks = true;
      continue;
    }
    if (flag == "--cpu-offload") {
      o.cpu_offload = true;
      continue;
    }
    auto it = with_value.find(flag);
    if (it == with_value.end()) throw std::invalid_argument("unknown option '" + args[i] + "'");
    if (!inline_value) {
      if (i + 1 >= args.size()) throw std::invalid_argument(flag + " needs a value");
      value = args[++i];
    }
    it->second(value);
  }
  const bool fsdp = o.strategy == "fsdp" || o.strategy == "hsdp";
  if (!fsdp && (!o.sharding.empty() || o.init_on_ranks || o.shard_size > 0)) {
    throw std::invalid_argument("--sharding, --shard-size and --init-on-ranks apply to --strategy fsdp or hsdp");
  }
  if (o.strategy == "hsdp" && !o.sharding.empty() && o.sharding != "hybrid") {
    throw std::invalid_argument("--strategy hsdp is hybrid sharding; use --strategy fsdp --sharding " + o.sharding);
  }
  if (!fsdp && (!o.backward_prefetch.empty() || !o.overlap_reduction.empty() || o.max_gathered_units > 0)) {
    throw std::invalid_argument("--backward-prefetch, --overlap-reduction and --max-gathered-units apply to --strategy "
                                "fsdp or hsdp");
  }
  if (fsdp && o.sharding.empty()) o.sharding = o.strategy == "hsdp" ? "hybrid" : "full";
  if (o.shard_size > 0 && o.sharding != "hybrid") throw std::invalid_argument("--shard-size applies to hybrid sharding");
  if (o.cpu_offload && !fsdp) {
    throw std::invalid_argument("--cpu-offload applies to --strategy fsdp or hsdp (ddp and zero keep every tensor on "
                                "--device)");
  }
  if (o.precision == "fp16" && o.device != "cuda") {
    throw std::invalid_argument("--precision fp16 needs --device cuda (fp16 autocast is CUDA-only in libtorch); on "
                                "the CPU use --precision bf16");
  }
  if (o.backend == "nccl" && o.device != "cuda") {
    throw std::invalid_argument("--backend nccl moves CUDA tensors only: use --device cuda, or --backend gloo");
  }
  if (o.loss_scale.empty()) o.loss_scale = o.precision == "fp16" ? "dynamic" : "none";
  if (growth_interval_given && o.loss_scale != "dynamic") {
    throw std::invalid_argument("--loss-scale-growth-interval applies to --loss-scale dynamic");
  }
  if (o.save_every > 0 && o.save.empty()) {
    throw std::invalid_argument("--save-every needs --save DIR (where to write the checkpoints)");
  }
  if (o.d_model % o.heads != 0) {
    throw std::invalid_argument("--d-model (" + std::to_string(o.d_model) + ") must be divisible by --heads (" +
                                std::to_string(o.heads) + ")");
  }
  return o;
}

}  // namespace gpt_demo
