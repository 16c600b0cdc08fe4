"""The PyTorch peer of dtrain-gpt for the benchmarks: the same model (bench/gpt_model.py, same
initialisation), the same data and data order (DistributedSampler, shuffle, drop_last), the same
optimizer and the same per-step report (an all_gather of [loss, peak RSS]), trained with
torch.nn.parallel.DistributedDataParallel over Gloo. Writes the same JSON-lines metrics.

Run with Debian's python3-torch (1.13; torchrun needs --redirects 1 --tee 1 on Python 3.11):
  /usr/bin/python3 -m torch.distributed.run --redirects 1 --tee 1 --standalone \
      --nproc-per-node 2 bench/gpt_ddp.py --threads 1 --steps 30 --metrics /tmp/py.jsonl
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import GPT, GPTConfig, gpt_loss, init_weights  # noqa: E402


def read_text_bytes(path):
    """dtrain::data::read_text_bytes: a file, or a directory's regular files sorted by name,
    symlinks followed and each target read once."""
    if not os.path.isdir(path):
        return open(path, "rb").read()
    out, seen = [], set()
    for name in sorted(os.listdir(path)):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            continue
        real = os.path.realpath(f)
        if real in seen:
            continue
        seen.add(real)
        out.append(open(f, "rb").read())
    return b"".join(out)


def peak_rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--data", default="/usr/share/common-licenses")
    ap.add_argument("--metrics", default="")
    ap.add_argument("--zero", action="store_true",
                    help="shard the optimizer state with torch.distributed.optim.ZeroRedundancyOptimizer")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    data = torch.frombuffer(bytearray(read_text_bytes(a.data)), dtype=torch.uint8).long()
    n_samples = (data.numel() - a.seq_len - 1) // a.seq_len + 1
    sampler = DistributedSampler(range(n_samples), num_replicas=world, rank=rank, shuffle=True,
                                 seed=a.seed, drop_last=True)
    steps_per_epoch = len(sampler) // a.batch_size
    offsets = torch.arange(a.seq_len + 1)

    model = GPT(GPTConfig(seq_len=a.seq_len, layers=a.layers, d_model=a.d_model, heads=a.heads))
    init_weights(model, a.seed)
    ddp = DDP(model, bucket_cap_mb=a.bucket_cap_mb)
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=a.lr, weight_decay=0.01)
        local_opt = opt.optim
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr, weight_decay=0.01)
        local_opt = opt

    out = open(a.metrics, "w") if (a.metrics and rank == 0) else None
    epoch, order, total = -1, None, 0.0
    tokens_per_step = a.batch_size * world * a.seq_len
    for step in range(a.steps):
        t0 = time.perf_counter()
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            sampler.set_epoch(epoch)
            order = list(sampler)
        first = (step % steps_per_epoch) * a.batch_size
        idx = torch.tensor(order[first:first + a.batch_size]) * a.seq_len
        windows = data[idx.unsqueeze(1) + offsets]
        x, y = windows[:, :-1], windows[:, 1:]
        opt.zero_grad()
        f0 = time.perf_counter()
        loss = gpt_loss(ddp(x), y)
        f1 = time.perf_counter()
        loss.backward()
        f2 = time.perf_counter()
        opt.step()
        f3 = time.perf_counter()
        mine = torch.tensor([loss.item(), peak_rss_mib()], dtype=torch.float64)
        allr = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(allr, mine)
        dt = time.perf_counter() - t0
        total += dt
        if out:
            allr = torch.stack(allr)
            out.write(json.dumps({"step": step + 1, "loss": allr[:, 0].mean().item(),
                                  "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                                  "forward_s": f1 - f0, "backward_s": f2 - f1, "optimizer_s": f3 - f2,
                                  "peak_rss_mib": allr[:, 1].max().item()}) + "\n")
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    sq = sum(p.detach().double().pow(2).sum().item() for p in model.parameters())
    state_mib = sum(t.numel() * t.element_size() for st in local_opt.state.values()
                    for t in st.values() if torch.is_tensor(t)) / 1048576.0
    rss = [torch.empty(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rss, torch.tensor([peak_rss_mib(), state_mib], dtype=torch.float64))
    if out:
        out.write(json.dumps({"final": True, "steps": a.steps, "world_size": world, "strategy": "pytorch-zero1" if a.zero else "pytorch-ddp",
                              "param_checksum": checksum, "param_sq": sq,
                              "tokens_per_s": tokens_per_step * a.steps / total,
                              "mean_step_time_s": total / a.steps,
                              "peak_rss_mib_per_rank": [r[0].item() for r in rss],
                              "optimizer_state_mib_per_rank": [r[1].item() for r in rss],
                              "threads_per_rank": torch.get_num_threads()}) + "\n")
        out.close()
    # Leave without tearing down: in torch 1.13 with Python 3.11, destroying the DDP Reducer and
    # the Gloo group at exit can deadlock one rank (its TCPStore thread spinning on a closed
    # socket). Every rank has finished its collectives here, so a hard exit is safe.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
