#include "dtrain/train/config.h"

#include <cstdio>
#include <iostream>
#include <stdexcept>

#include "dtrain/train/planner.h"
#include "dtrain/util/parse.h"

namespace dtrain::train {

int64_t int_flag(const std::string& flag, const std::string& v, int64_t lo) {
  auto x = util::parse_int(v);
  if (!x || *x < lo) {
    throw std::invalid_argument(flag + " expects an integer >= " + std::to_string(lo) + ", got '" + v + "'");
  }
  return *x;
}

double positive_flag(const std::string& flag, const std::string& v) {
  auto x = util::parse_double(v);
  if (!x || !(*x > 0)) throw std::invalid_argument(flag + " expects a positive number, got '" + v + "'");
  return *x;
}

std::string choice_flag(const std::string& flag, const std::string& v, const std::vector<std::string>& choices) {
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i] == v) return v;
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  }
  throw std::invalid_argument(flag + " must be " + list + ", got '" + v + "'");
}

std::string usage(const std::string& program, const std::string& summary, const ExtraFlags& extra) {
  std::string s = "usage: " + program + " [options]      (run under dtrun for several ranks)\n";
  if (!summary.empty()) s += summary + (summary.back() == '\n' ? "" : "\n");
  s += R"(  --strategy S              how to train (default ddp):
                              single  one process
                              dp      one process over every local GPU (DataParallel: batch
                                      scattered, model replicated; single with < 2 GPUs)
                              ddp     DistributedDataParallel (gradients all-reduced)
                              zero1   DDP + optimizer state sharded across ranks (ZeRO-1)
                              zero2   gradients reduce-scattered to their owners + sharded
                                      optimizer state (ZeRO-2)
                              fsdp    FullyShardedDataParallel (ZeRO-3): parameters, gradients
                                      and optimizer state sharded (--sharding, default full)
                              hsdp    FSDP with hybrid sharding: sharded within a node,
                                      replicated across nodes (= fsdp --sharding hybrid)
                              auto    the memory planner picks the fastest that fits
                                      --memory-budget: ddp, zero1, zero2, fsdp, then fsdp
                                      with activation checkpointing (single, single with
                                      it on one rank), then --tp and --pp layouts where the
                                      program builds its model per layout (dtrain-gpt,
                                      dtrain-mlp); it prints the table it chose from
  --memory-budget SIZE      --strategy auto: memory per rank, e.g. 512MiB or 4GiB (default: the
                            GPU's memory, or on the CPU the available memory / local ranks)
  --plan                    print the memory plan (each layout's predicted peak per rank:
                            parameters, gradients, optimizer state, buffers, one step measured
                            on one micro-batch) and stop without training
  --sharding full|grad_op|none|hybrid   fsdp/hsdp sharding strategy
  --wrap layer|none         fsdp/hsdp units: one per layer of the model (default; "block" is the
                            same) or one in all
  --shard-size N            hybrid: ranks per shard group (default: ranks per node)
  --init-on-ranks           fsdp/hsdp: build the model without values and initialise it one
                            parameter at a time into the shards (no rank holds the whole model)
  --backward-prefetch before|after|none   fsdp/hsdp: when backward gathers the next unit (before)
  --overlap-reduction on|off  fsdp/hsdp: a unit's gradient reduction overlaps the next unit's
                            backward (on); off with --backward-prefetch after: the memory-lean
                            backward, one unit's parameters and gradients at a time (docs/fsdp.md)
  --max-gathered-units N    fsdp/hsdp: nested units gathered at once by prefetching (2)
  --batch-size N            samples per rank per micro-batch (8)
  --grad-accum N            micro-batches per step (1); no gradient sync until the last
  --steps N                 optimizer steps (100)
  --lr X                    learning rate (1e-3)
  --optimizer adamw|sgd     AdamW (weight decay 0.01) or SGD with momentum 0.9 (adamw)
  --seed N                  model init and data order (0)
  --threads N               intra-op threads per rank (default: cores / local ranks)
  --metrics FILE            JSON lines: one per step, then a final summary (rank 0 writes); with
                            --device cuda also peak_gpu_mib, and mfu where the peak is known
  --tensorboard DIR         TensorBoard event files in DIR (rank 0): loss, tokens/s, learning rate,
                            gradient norm, loss scale and peak RSS per step
  --peak-tflops X           the device's peak TFLOP/s for the mfu metric (default: known GPUs'
                            dense bf16/fp16 peak by name; none on the CPU unless given)
  --bucket-cap-mb X         gradient bucket size for ddp/zero1/zero2 (25)
  --clip-grad-norm X        clip gradients to this global 2-norm (default: no clipping)
  --activation-checkpointing  recompute each layer's activations in backward (less memory)
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
  --collective-timeout S    seconds a collective may wait for the other ranks before it fails
                            naming the ranks that never reached it (1800, as torch.distributed)
  --max-skipped-steps N     dynamic: stop the run (exit 1) after N steps in a row skipped for
                            inf/NaN gradients (10; 0: never). Without loss scaling a non-finite
                            loss or gradient norm stops the run at once
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
  --pp N                    pipeline parallelism: the model cut into N stages on N ranks (x
                            --virtual-stages); world size / N ranks of data parallelism around
                            each stage (--strategy ddp, zero1 or fsdp; single when world
                            size = N)
  --microbatches M          --pp: micro-batches each batch-size batch is cut into (default N)
  --schedule gpipe|1f1b|interleaved   --pp: the pipeline schedule (1f1b; interleaved with
                            --virtual-stages > 1)
  --virtual-stages V        --pp: stages per pipeline rank (interleaved schedule; 1)
  --tp N                    tensor parallelism: each layer's matrices split over N ranks (the
                            program builds its model from tensor_parallel layers); world size / N
                            ranks of data parallelism (--strategy ddp; single when world size = N)
  --sequence-parallel       --tp: activations between the split layers cut along the sequence
)";
  s += extra.usage;
  if (!extra.usage.empty() && extra.usage.back() != '\n') s += "\n";
  s += "The global batch (ranks x batch-size x grad-accum) at step t is the same set of samples for\n"
       "any number of ranks, so runs with equal global batches are comparable.\n";
  return s;
}

void TrainConfig::drop_sharding_flags() {
  cpu_offload = false;
  sharding.clear();
  shard_size = 0;
  init_on_ranks = false;
  backward_prefetch.clear();
  overlap_reduction.clear();
  max_gathered_units = 0;
}

void TrainConfig::validate() {
  if (strategy == "auto" && (tp > 1 || pp > 1)) {
    throw std::invalid_argument("--strategy auto picks the layout itself (data parallel, and tensor and pipeline "
                                "parallel where the program builds its model per layout): give --strategy with --tp or "
                                "--pp, or leave them out");
  }
  const bool sharded = fsdp();
  if (!sharded && (!sharding.empty() || init_on_ranks || shard_size > 0)) {
    throw std::invalid_argument("--sharding, --shard-size and --init-on-ranks apply to --strategy fsdp or hsdp");
  }
  if (strategy == "hsdp" && !sharding.empty() && sharding != "hybrid") {
    throw std::invalid_argument("--strategy hsdp is hybrid sharding; use --strategy fsdp --sharding " + sharding);
  }
  if (!sharded && (!backward_prefetch.empty() || !overlap_reduction.empty() || max_gathered_units > 0)) {
    throw std::invalid_argument("--backward-prefetch, --overlap-reduction and --max-gathered-units apply to --strategy "
                                "fsdp or hsdp");
  }
  if (sharded && sharding.empty()) sharding = strategy == "hsdp" ? "hybrid" : "full";
  if (shard_size > 0 && sharding != "hybrid") throw std::invalid_argument("--shard-size applies to hybrid sharding");
  if (cpu_offload && !sharded) {
    throw std::invalid_argument("--cpu-offload applies to --strategy fsdp or hsdp (ddp and zero keep every tensor on "
                                "--device)");
  }
  if (precision == "fp16" && device != "cuda") {
    throw std::invalid_argument("--precision fp16 needs --device cuda (fp16 autocast is CUDA-only in libtorch); on "
                                "the CPU use --precision bf16");
  }
  if (backend == "nccl" && device != "cuda") {
    throw std::invalid_argument("--backend nccl moves CUDA tensors only: use --device cuda, or --backend gloo");
  }
  if (loss_scale.empty()) loss_scale = precision == "fp16" ? "dynamic" : "none";
  if (pp == 1 && (microbatches > 0 || !schedule.empty() || virtual_stages > 1)) {
    throw std::invalid_argument("--microbatches, --schedule and --virtual-stages apply to pipeline parallelism (--pp N)");
  }
  if (pp > 1) {
    // Around the stages (Design note [sharded stages], pipeline/sharded_stages.h): a stage's
    // gradients accumulate in full over the micro-batches and are reduced once per step.
    if (strategy == "zero2") {
      throw std::invalid_argument("--pp with --strategy zero2: a pipeline step accumulates every micro-batch's "
                                  "gradients in full, so sharding them saves nothing over zero1 (DeepSpeed's pipeline "
                                  "allows ZeRO-1 only); use --strategy zero1, or fsdp to shard the parameters too");
    }
    if (strategy == "hsdp" || strategy == "dp") {
      throw std::invalid_argument("--pp with --strategy " + strategy + " is not supported: around the stages use "
                                  "single, ddp, zero1 or fsdp");
    }
    if (sharded && (sharding != "full" || init_on_ranks || cpu_offload || !backward_prefetch.empty() ||
                    !overlap_reduction.empty() || max_gathered_units > 0)) {
      throw std::invalid_argument("--strategy fsdp around pipeline stages makes each stage one unit, gathered for the "
                                  "whole step (--sharding full); --sharding, --init-on-ranks, --cpu-offload, "
                                  "--backward-prefetch, --overlap-reduction and --max-gathered-units do not apply");
    }
    if (schedule.empty()) schedule = virtual_stages > 1 ? "interleaved" : "1f1b";
    if (schedule == "interleaved" && virtual_stages < 2)
      throw std::invalid_argument("--schedule interleaved needs --virtual-stages 2 or more");
    if (schedule != "interleaved" && virtual_stages > 1)
      throw std::invalid_argument("--virtual-stages " + std::to_string(virtual_stages) + " needs --schedule interleaved");
    const bool defaulted = microbatches == 0;
    if (defaulted) microbatches = pp;
    if (batch_size % microbatches != 0)
      throw std::invalid_argument("--microbatches " + std::to_string(microbatches) + (defaulted ? " (default: --pp)" : "") +
                                  " must divide --batch-size " + std::to_string(batch_size) +
                                  (defaulted ? "; give --microbatches" : ""));
    if (schedule == "interleaved" && microbatches % pp != 0)
      throw std::invalid_argument("--schedule interleaved needs the micro-batches (" + std::to_string(microbatches) +
                                  ") to be a multiple of the pipeline ranks (" + std::to_string(pp) + ")");
  }
  if (sequence_parallel && tp == 1) throw std::invalid_argument("--sequence-parallel applies to tensor parallelism (--tp N)");
  if (tp > 1) {
    if (strategy != "single" && strategy != "ddp" && !fsdp()) {
      throw std::invalid_argument("--tp with --strategy " + strategy + " is not supported: around the "
                                  "tensor-parallel groups use single (world size = --tp), ddp, fsdp or hsdp "
                                  "(ZeRO-1/2's sharded optimizer over pieces is not built; fsdp shards more)");
    }
    if (pp > 1 && strategy != "single" && strategy != "ddp") {
      throw std::invalid_argument("--tp with --pp takes --strategy single or ddp around the stages (" + strategy +
                                  " around tensor-parallel stages is not built)");
    }
  }
  if (memory_budget > 0 && strategy != "auto" && !plan) {
    throw std::invalid_argument("--memory-budget applies to --strategy auto (or --plan, to mark what fits)");
  }
  if (plan && (tp > 1 || pp > 1)) {
    throw std::invalid_argument("--plan lists the layouts itself (data parallel, and tensor and pipeline parallel where "
                                "the program builds its model per layout); leave out --tp and --pp");
  }
  if (save_every > 0 && save.empty()) {
    throw std::invalid_argument("--save-every needs --save DIR (where to write the checkpoints)");
  }
}

TrainConfig parse_config(const std::vector<std::string>& args, const ExtraFlags& extra, TrainConfig defaults) {
  TrainConfig o = std::move(defaults);
  bool growth_interval_given = false, wrap_given = false, skipped_given = false;
  std::map<std::string, std::function<void(const std::string&)>> with_value = {
      {"--strategy", [&](const std::string& v) {
         o.strategy = choice_flag("--strategy", v, {"single", "dp", "ddp", "zero1", "zero2", "fsdp", "hsdp", "auto"});
       }},
      {"--batch-size", [&](const std::string& v) { o.batch_size = int_flag("--batch-size", v, 1); }},
      {"--grad-accum", [&](const std::string& v) { o.grad_accum = int_flag("--grad-accum", v, 1); }},
      {"--steps", [&](const std::string& v) { o.steps = int_flag("--steps", v, 1); }},
      {"--lr", [&](const std::string& v) { o.lr = positive_flag("--lr", v); }},
      {"--seed", [&](const std::string& v) { o.seed = static_cast<uint64_t>(int_flag("--seed", v, 0)); }},
      {"--optimizer", [&](const std::string& v) { o.optimizer = choice_flag("--optimizer", v, {"adamw", "sgd"}); }},
      {"--threads", [&](const std::string& v) { o.threads = static_cast<int>(int_flag("--threads", v, 1)); }},
      {"--metrics", [&](const std::string& v) { o.metrics = v; }},
      {"--tensorboard", [&](const std::string& v) {
         if (v.empty()) throw std::invalid_argument("--tensorboard needs a directory");
         o.tensorboard = v;
       }},
      {"--peak-tflops", [&](const std::string& v) { o.peak_tflops = positive_flag("--peak-tflops", v); }},
      {"--bucket-cap-mb", [&](const std::string& v) { o.bucket_cap_mb = positive_flag("--bucket-cap-mb", v); }},
      {"--clip-grad-norm", [&](const std::string& v) { o.clip_grad_norm = positive_flag("--clip-grad-norm", v); }},
      {"--sharding", [&](const std::string& v) {
         o.sharding = choice_flag("--sharding", v, {"full", "grad_op", "none", "hybrid"});
       }},
      {"--wrap", [&](const std::string& v) {
         o.wrap = choice_flag("--wrap", v, {"layer", "block", "none"});
         if (o.wrap == "block") o.wrap = "layer";
         wrap_given = true;
       }},
      {"--shard-size", [&](const std::string& v) { o.shard_size = static_cast<int>(int_flag("--shard-size", v, 1)); }},
      {"--backward-prefetch", [&](const std::string& v) {
         o.backward_prefetch = choice_flag("--backward-prefetch", v, {"before", "after", "none"});
       }},
      {"--overlap-reduction", [&](const std::string& v) {
         o.overlap_reduction = choice_flag("--overlap-reduction", v, {"on", "off"});
       }},
      {"--max-gathered-units", [&](const std::string& v) {
         o.max_gathered_units = static_cast<int>(int_flag("--max-gathered-units", v, 1));
       }},
      {"--memory-budget", [&](const std::string& v) { o.memory_budget = parse_memory_size("--memory-budget", v); }},
      {"--pp", [&](const std::string& v) { o.pp = static_cast<int>(int_flag("--pp", v, 1)); }},
      {"--tp", [&](const std::string& v) { o.tp = static_cast<int>(int_flag("--tp", v, 1)); }},
      {"--microbatches", [&](const std::string& v) { o.microbatches = static_cast<int>(int_flag("--microbatches", v, 1)); }},
      {"--schedule", [&](const std::string& v) { o.schedule = choice_flag("--schedule", v, {"gpipe", "1f1b", "interleaved"}); }},
      {"--virtual-stages", [&](const std::string& v) {
         o.virtual_stages = static_cast<int>(int_flag("--virtual-stages", v, 1));
       }},
      {"--save", [&](const std::string& v) { o.save = v; }},
      {"--save-every", [&](const std::string& v) { o.save_every = int_flag("--save-every", v, 1); }},
      {"--resume", [&](const std::string& v) { o.resume = v; }},
      {"--export-weights", [&](const std::string& v) {
         if (v.empty()) throw std::invalid_argument("--export-weights needs a file name");
         o.export_weights = v;
       }},
      {"--precision", [&](const std::string& v) { o.precision = choice_flag("--precision", v, {"fp32", "bf16", "fp16"}); }},
      {"--device", [&](const std::string& v) { o.device = choice_flag("--device", v, {"cpu", "cuda"}); }},
      {"--backend", [&](const std::string& v) { o.backend = choice_flag("--backend", v, {"auto", "gloo", "nccl"}); }},
      {"--loss-scale", [&](const std::string& v) { o.loss_scale = choice_flag("--loss-scale", v, {"none", "dynamic"}); }},
      {"--collective-timeout", [&](const std::string& v) {
         o.collective_timeout_s = static_cast<double>(int_flag("--collective-timeout", v, 1));
       }},
      {"--max-skipped-steps", [&](const std::string& v) {
         o.max_skipped_steps = int_flag("--max-skipped-steps", v, 0);
         skipped_given = true;
       }},
      {"--loss-scale-growth-interval", [&](const std::string& v) {
         o.loss_scale_growth_interval = int_flag("--loss-scale-growth-interval", v, 1);
         growth_interval_given = true;
       }},
  };
  const std::map<std::string, bool*> switches = {{"--activation-checkpointing", &o.activation_checkpointing},
                                                 {"--init-on-ranks", &o.init_on_ranks},
                                                 {"--sequence-parallel", &o.sequence_parallel},
                                                 {"--cpu-offload", &o.cpu_offload},
                                                 {"--plan", &o.plan}};
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::string value;
    bool inline_value = false;
    if (auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      inline_value = true;
    }
    if (auto s = switches.find(flag); s != switches.end() && !inline_value) {
      *s->second = true;
      continue;
    }
    if (auto s = extra.switches.find(flag); s != extra.switches.end() && !inline_value) {
      s->second();
      continue;
    }
    std::function<void(const std::string&)> set;
    if (auto it = with_value.find(flag); it != with_value.end()) set = it->second;
    if (auto it = extra.valued.find(flag); !set && it != extra.valued.end()) set = it->second;
    if (!set) throw std::invalid_argument("unknown option '" + args[i] + "'");
    if (!inline_value) {
      if (i + 1 >= args.size()) throw std::invalid_argument(flag + " needs a value");
      value = args[++i];
    }
    set(value);
  }
  o.validate();
  if (wrap_given && !o.fsdp()) throw std::invalid_argument("--wrap applies to --strategy fsdp or hsdp");
  if (wrap_given && o.pp > 1) {
    throw std::invalid_argument("--wrap picks FSDP's units; with --pp each pipeline stage is one unit");
  }
  if (skipped_given && o.loss_scale != "dynamic") {
    throw std::invalid_argument("--max-skipped-steps applies to --loss-scale dynamic (without it a non-finite loss "
                                "or gradient norm stops the run at once)");
  }
  if (growth_interval_given && o.loss_scale != "dynamic") {
    throw std::invalid_argument("--loss-scale-growth-interval applies to --loss-scale dynamic");
  }
  if (extra.check) extra.check();
  return o;
}

std::optional<int> parse_command_line(int argc, char** argv, TrainConfig& cfg, const ExtraFlags& extra,
                                      const std::string& summary) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& a : args) {
    if (a == "--help" || a == "-h") {
      std::cout << usage(cfg.program, summary, extra);
      return 0;
    }
  }
  try {
    cfg = parse_config(args, extra, cfg);
  } catch (const std::exception& e) {
    std::cerr << cfg.program << ": " << e.what() << "\n\n" << usage(cfg.program, summary, extra);
    return 2;
  }
  return std::nullopt;
}

}  // namespace dtrain::train
