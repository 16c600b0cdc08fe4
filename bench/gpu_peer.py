"""The PyTorch peer of `dtrain-gpt --device cuda --precision bf16` for bench/gpu_bench.py: the same
model (bench/gpt_model.py with F.scaled_dot_product_attention, same initialisation), the same data
and order (DistributedSampler, shuffle, drop_last), AdamW (weight decay 0.01), the same per-step
metrics (JSON lines), trained one of three ways:
  single  one process, no wrapper;
  ddp     torch.nn.parallel.DistributedDataParallel;
  fsdp2   FSDP2: fully_shard on every GPTBlock, then on the root, MixedPrecisionPolicy(param_dtype
          bf16, reduce_dtype fp32) as dtrain's FSDP does (torch 2.4+; the import moved from
          torch.distributed._composable.fsdp to torch.distributed.fsdp in 2.6).
bf16: the forward and loss under torch.autocast (single, ddp) with fp32 weights, as dtrain-gpt.
The final record adds peak_gpu_mib (torch.cuda.max_memory_allocated, the caching allocator's
high-water mark, max over ranks) on CUDA.

  torchrun --standalone --nproc-per-node 8 bench/gpu_peer.py --strategy fsdp2 --device cuda \
      --precision bf16 --layers 16 --d-model 2048 --heads 16 --seq-len 1024 --batch-size 8 \
      --steps 30 --metrics /tmp/py.jsonl
Runs on the CPU too (--device cpu: single and ddp with torch 1.13, for the benchmark's smoke test).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_ddp import peak_rss_mib, read_text_bytes  # noqa: E402
from gpt_model import GPT, GPTBlock, GPTConfig, gpt_loss, init_weights  # noqa: E402


def import_fully_shard():
    # Any failure (ImportError; on 1.13 with Python 3.11 importing torch.distributed.fsdp itself
    # raises ValueError) means: no FSDP2 here.
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # 2.6+
    except Exception:  # noqa: BLE001
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard  # 2.4, 2.5
        except Exception as e:  # noqa: BLE001
            sys.stderr.write("gpu_peer: torch %s has no FSDP2 fully_shard (needs 2.4 or later): %s: %s\n" %
                             (torch.__version__, type(e).__name__, str(e).strip().splitlines()[-1][:120] if str(e).strip() else ""))
            sys.exit(3)
    return fully_shard, MixedPrecisionPolicy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=["single", "ddp", "fsdp2"], default="ddp")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--attention", choices=["fused", "math"], default="fused")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default="/usr/share/common-licenses")
    ap.add_argument("--metrics", default="")
    ap.add_argument("--profile", default="", help="PATH[@FIRST:LAST]: a kernel profile of steps FIRST..LAST "
                    "(1-based, default 3:4), rank 0, as dtrain's DTRAIN_PROFILE (bench/profile_summary.py)")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    distributed = a.strategy != "single"
    if distributed:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(device)

    data = torch.frombuffer(bytearray(read_text_bytes(a.data)), dtype=torch.uint8).long()
    n_samples = (data.numel() - a.seq_len - 1) // a.seq_len + 1
    sampler = DistributedSampler(range(n_samples), num_replicas=world, rank=rank, shuffle=True,
                                 seed=a.seed, drop_last=True)
    steps_per_epoch = len(sampler) // a.batch_size
    offsets = torch.arange(a.seq_len + 1)

    model = GPT(GPTConfig(seq_len=a.seq_len, layers=a.layers, d_model=a.d_model, heads=a.heads,
                          fused_attention=a.attention == "fused"))
    init_weights(model, a.seed)
    model.to(device)
    bf16 = a.precision == "bf16"
    autocast = bf16
    if a.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model, device_ids=[local_rank] if a.device == "cuda" else None)
    elif a.strategy == "fsdp2":
        fully_shard, MixedPrecisionPolicy = import_fully_shard()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for m in model.modules():
            if isinstance(m, GPTBlock):
                fully_shard(m, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        net = model
        autocast = False  # FSDP2 computes in param_dtype itself
    else:
        net = model
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)

    out = open(a.metrics, "w") if (a.metrics and rank == 0) else None
    epoch, order, total = -1, None, 0.0
    tokens_per_step = a.batch_size * world * a.seq_len
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)

    def rows(values):
        """Every rank's `values` as a [world, len(values)] CPU tensor (one all_gather)."""
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        if not distributed:
            return mine.cpu().view(1, -1)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        return torch.stack(parts).cpu()
    prof_path, prof_first, prof_last = a.profile, 3, 4
    if "@" in prof_path:
        prof_path, steps_spec = prof_path.rsplit("@", 1)
        prof_first, prof_last = (int(v) for v in steps_spec.split(":"))
    prof = None
    for step in range(a.steps):
        if prof_path and step + 1 == prof_first:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] +
                                          ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else []))
            prof.__enter__()
        t0 = time.perf_counter()
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            sampler.set_epoch(epoch)
            order = list(sampler)
        first = (step % steps_per_epoch) * a.batch_size
        idx = torch.tensor(order[first:first + a.batch_size]) * a.seq_len
        windows = data[idx.unsqueeze(1) + offsets].to(device, non_blocking=True)
        x, y = windows[:, :-1], windows[:, 1:]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = gpt_loss(net(x), y)
        loss.backward()
        opt.step()
        allr = rows([loss.item(), peak_rss_mib()])
        sync()
        dt = time.perf_counter() - t0
        total += dt
        if prof is not None and step + 1 == prof_last:
            prof.__exit__(None, None, None)
            if rank == 0:
                from profile_summary import from_chrome_trace
                prof.export_chrome_trace(prof_path + ".trace")
                summary = from_chrome_trace(prof_path + ".trace", prof_last - prof_first + 1)
                os.remove(prof_path + ".trace")
                with open(prof_path, "w") as f:
                    json.dump(summary, f)
            prof = None
        if out:
            out.write(json.dumps({"step": step + 1, "loss": allr[:, 0].mean().item(),
                                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                                  "peak_rss_mib": allr[:, 1].max().item()}) + "\n")
    gpu = torch.cuda.max_memory_allocated(device) / 1048576.0 if a.device == "cuda" else -1.0
    allm = rows([peak_rss_mib(), gpu])
    if out:
        rec = {"final": True, "steps": a.steps, "world_size": world, "strategy": "pytorch-" + a.strategy,
               "torch": torch.__version__, "tokens_per_s": tokens_per_step * a.steps / total,
               "mean_step_time_s": total / a.steps, "peak_rss_mib_per_rank": allm[:, 0].tolist(),
               "threads_per_rank": torch.get_num_threads()}
        if a.device == "cuda":
            rec.update(peak_gpu_mib=allm[:, 1].max().item(), peak_gpu_mib_per_rank=allm[:, 1].tolist(),
                       gpu=torch.cuda.get_device_name(device))
        out.write(json.dumps(rec) + "\n")
        out.close()
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        dist.barrier()
    os._exit(0)  # as gpt_ddp.py: no teardown (1.13 + Python 3.11 can deadlock in it)


if __name__ == "__main__":
    main()
