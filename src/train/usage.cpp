// The --help text of the common flags (config.h).
#include <string>

#include "dtrain/train/config.h"

namespace dtrain::train {

namespace {
// The common flags, in four groups.
const char* const kPlanFlags = R"(  --strategy S              how to train (default ddp):
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
                              auto    the memory planner picks the fastest plan that fits
                                      --memory-budget: ddp, zero1, zero2, fsdp, then fsdp
                                      with activation checkpointing (single, single with
                                      it on one rank), then --tp, --pp and --tp x --pp
                                      layouts where the program builds its model per layout
                                      (dtrain-gpt, dtrain-mlp); it prints the table it chose
                                      from. Every kind composes with --tp and --pp, but
                                      zero2 with --pp (it would save nothing over zero1)
  --config FILE             read the flags from a TOML (.toml) or JSON (.json) document: every
                            flag a key (batch_size = 8, strategy = "fsdp", plan = true); the
                            command line overrides it
  --print-config            print the resolved configuration as TOML and stop
  --memory-budget SIZE      --strategy auto: memory per rank, e.g. 512MiB or 4GiB (default: the
                            GPU's memory, or on the CPU the available memory / local ranks);
                            --elastic: every membership's plan is checked against it
  --plan                    print the memory plan (each layout's predicted peak per rank:
                            parameters, gradients, optimizer state, buffers, one step measured
                            on one micro-batch) and stop without training
)";

const char* const kShardingFlags = R"(  --sharding full|grad_op|none|hybrid   fsdp/hsdp sharding strategy
  --wrap layer|none         fsdp/hsdp units: one per layer of the model (default; "block" is the
                            same) or one in all
  --shard-size N            hybrid: ranks per shard group (default: ranks per node / --tp)
  --init-on-ranks           fsdp/hsdp: build the model without values and initialise it one
                            parameter at a time into the shards (no rank holds the whole model)
  --backward-prefetch before|after|none   fsdp/hsdp: when backward gathers the next unit (before)
  --overlap-reduction on|off  fsdp/hsdp: a unit's gradient reduction overlaps the next unit's
                            backward (on); off with --backward-prefetch after: the memory-lean
                            backward, one unit's parameters and gradients at a time (docs/fsdp.md)
  --max-gathered-units N    fsdp/hsdp: nested units gathered at once by prefetching (2)
)";

const char* const kTrainingFlags = R"(  --batch-size N            samples per rank per micro-batch (8)
  --grad-accum N            micro-batches per step (1); no gradient sync until the last
  --global-batch-size N     samples per optimizer step, whatever the plan (default: ranks x
                            --batch-size x --grad-accum); a plan with fewer data-parallel ranks
                            (--tp, --pp) accumulates more micro-batches of --batch-size
  --steps N                 optimizer steps (100)
  --lr X                    peak learning rate (1e-3)
  --lr-schedule constant|cosine|linear|wsd
                            after --warmup-steps: constant, cosine or linear decay to --min-lr at
                            --steps, or warm-up-stable-decay over the last --decay-steps (constant)
  --warmup-steps N          linear warm-up to --lr over the first N steps (0)
  --min-lr X                cosine/linear/wsd: the learning rate of the last step (0)
  --decay-steps N           wsd: the steps of the final linear decay
  --optimizer adamw|sgd     AdamW or SGD with momentum 0.9 (adamw)
  --weight-decay X          decoupled (AdamW, 0.01) or L2 (SGD, 0)
  --beta1 X --beta2 X --eps X  AdamW's (0.9, 0.999, 1e-8)
  --seed N                  model init and data order (0)
  --eval-every N            the validation loss every N steps and after the last (val_loss in the
                            metrics, TensorBoard and the progress); needs --val-fraction or --val-data
  --eval-batches M          global batches of held-out samples per evaluation (default: all)
  --val-fraction F          hold out the last F of the samples (not trained on)
  --val-data PATH           held-out samples from PATH (programs that read data files)
  --eval-only               with --resume DIR: evaluate that checkpoint (any plan) and stop
  --threads N               intra-op threads per rank (default: cores / local ranks)
  --metrics FILE            JSON lines: one per step, then a final summary (rank 0 writes); with
                            --device cuda also peak_gpu_mib, and mfu where the peak is known
  --tensorboard DIR         TensorBoard event files in DIR (rank 0): loss, tokens/s, learning rate,
                            gradient norm, loss scale and peak RSS per step
  --peak-tflops X           the device's peak TFLOP/s for the mfu metric (default: known GPUs'
                            dense bf16/fp16 peak by name; none on the CPU unless given)
  --bucket-cap-mb X         gradient bucket size for ddp/zero1/zero2 (25)
  --grad-compression C      gradients sent as none, bf16, fp16 (ddp/zero1/zero2) or powersgd:R[:WARMUP]
                            (ddp/zero1; rank R, WARMUP uncompressed steps first, default 10) (none)
  --hierarchical-all-reduce ddp/zero1: each gradient bucket all-reduced inside the node, then across
                            nodes once (where the ranks span nodes evenly: fewer bytes on the link;
                            with --grad-compression bf16/fp16 both levels in 16 bits)
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
  --elastic                 ddp, zero1, zero2, fsdp (these with --snapshot-every) under dtrun
                            --keep-survivors: when a rank dies the others drop the step in
                            flight, regroup and go on at the smaller size in process, same
                            global batch (docs/elastic.md)
  --elastic-join-timeout S  --elastic: how long survivors wait for a rank that neither rejoined
                            nor was declared dead before going on without it (30)
  --max-skipped-steps N     dynamic: stop the run (exit 1) after N steps in a row skipped for
                            inf/NaN gradients (10; 0: never). Without loss scaling a non-finite
                            loss or gradient norm stops the run at once
  --cpu-offload             fsdp/hsdp: master shards, gradients and optimizer state on the CPU
                            (the optimizer steps there); for --device cuda: with --device cpu
                            it changes nothing
  --gather-quant Q          fsdp/hsdp: parameters all-gathered as none, int8 or fp8 (block-quantized,
                            a scale per 256 values: 3.9x fewer bytes than fp32; master weights
                            stay exact)
  --reduce-quant Q          fsdp/hsdp: gradients reduced as none or int8 (quantized per sender,
                            summed in fp32; in two levels across nodes; HSDP's replica all-reduce
                            quantized too)
  --secondary-shard S       fsdp/hsdp: none or node (a copy of each unit's gathered parameters kept
                            over the node's ranks, so the backward gathers inside the node: 1/3
                            fewer bytes across nodes, 1/L of each unit more memory)
  --save DIR                write training checkpoints under DIR (after the last step, and every
                            --save-every N steps); atomic, sharded, resumable at any world size
  --save-every N            save every N steps (default: only at the end)
  --save-async              a save copies the state to host memory and the step goes on while a
                            background thread writes it (same files; at most one in flight)
  --snapshot-every N        every N steps each rank's checkpoint state is copied into the memory
                            of a partner rank (on another node where there are several)
  --snapshot-sync           with --snapshot-every 1: a step ends once its snapshot is everywhere
                            (--elastic redoes only the step in flight; the exchange no longer
                            overlaps the next step)
  --resume DIR              continue from DIR's latest checkpoint up to --steps (total); starts from
                            step 0 when DIR has none yet, so one command line works with restarts
  --export-weights PATH     after the last step, write the trained weights as one plain
                            safetensors file (for inference; fsdp/hsdp stream it unit by unit)
)";

const char* const kModelParallelFlags = R"(  --pp N                    pipeline parallelism: the model cut into N stages on N ranks (x
                            --virtual-stages); world size / N ranks of data parallelism around
                            each stage (--strategy ddp, zero1, fsdp or hsdp; single when world
                            size = N)
  --microbatches M          --pp: micro-batches each batch-size batch is cut into (default N)
  --schedule gpipe|1f1b|interleaved   --pp: the pipeline schedule (1f1b; interleaved with
                            --virtual-stages > 1)
  --virtual-stages V        --pp: stages per pipeline rank (interleaved schedule; 1)
  --tp N                    tensor parallelism: each layer's matrices split over N ranks (the
                            program builds its model from tensor_parallel layers); world size / N
                            ranks of data parallelism (any --strategy; single when world size = N)
  --sequence-parallel       --tp: activations between the split layers cut along the sequence
)";

}  // namespace

std::string usage(const std::string& program, const std::string& summary, const ExtraFlags& extra) {
  std::string s = "usage: " + program + " [options]      (run under dtrun for several ranks)\n";
  if (!summary.empty()) s += summary + (summary.back() == '\n' ? "" : "\n");
  s += std::string(kPlanFlags) + kShardingFlags + kTrainingFlags + kModelParallelFlags;
  s += extra.usage;
  if (!extra.usage.empty() && extra.usage.back() != '\n') s += "\n";
  s += "The global batch at step t is the same set of samples for any plan and number of ranks, so\n"
       "runs with equal global batches are comparable and resume each other's checkpoints.\n";
  return s;
}

}  // namespace dtrain::train
