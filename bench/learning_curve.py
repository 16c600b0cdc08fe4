"""dtrain's learning curve against PyTorch's over a long run (issue 28, item 5).

The same GPT (bench/gpt_model.py: dtrain's model in plain PyTorch, same initialisation), the same
SentencePiece token files (dtrain-tokenize over a fixed corpus), the same data order, warm-up +
cosine schedule, AdamW, seed and global batch, trained for --steps:

  dtrain ddp     dtrun, 2 ranks, --strategy ddp                      (seed 0)
  pytorch s0     PyTorch (Debian's python3-torch), one process, the global batch   (seed 0)
  pytorch s1     the same with seed 1: PyTorch's own run-to-run noise (init and data order)
  dtrain fsdp    2 ranks, --strategy fsdp                            (seed 0)
  dtrain pp2     2 ranks, --pp 2 (one data-parallel rank, 2 micro-batches per step)  (seed 0)

One process with the global batch trains the same steps as DDP at W = 2 (DistributedSampler's
permutation does not depend on the replicas: two ranks' batches of step k are the single batch's
samples). Validation: every --eval-every steps and at the end, the mean loss over the first
--eval-batches global batches of the validation windows, in order, as dtrain's --eval-every.

The comparison: training loss averaged over windows of --eval-every steps, and the validation loss,
at each evaluation from step --settle on; the mean absolute difference of each pair against the
noise (pytorch s1 against pytorch s0). Writes the metrics, a JSON summary, a Markdown table and an
SVG plot under --out.

  python3 bench/learning_curve.py --out bench/results/learning-curve      # 1,000 steps, ~20 min on 2 cores
  python3 bench/learning_curve.py --steps 60 --eval-every 20 --out /tmp/lc   # plumbing
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from benchlib import read_metrics  # noqa: E402


def lr_factor(step, warmup, total, min_factor):
    """optim::LrSchedule::factor for the cosine schedule (step 1-based)."""
    if step <= warmup:
        return step / (warmup + 1)
    span = total - warmup - 1
    p = 1.0 if span <= 0 else min(1.0, max(0.0, (step - warmup - 1) / span))
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * p))


def read_tokens(directory):
    """The token stream of a directory of Megatron .bin/.idx shards (dtrain-tokenize's), in name order."""
    import numpy as np
    parts = []
    for b in sorted(glob.glob(os.path.join(directory, "*.bin"))):
        with open(b[:-4] + ".idx", "rb") as f:
            head = f.read(18)
        assert head[:9] == b"MMIDIDX\x00\x00", "not a Megatron index: " + b
        code = head[17]
        dtype = {1: np.uint8, 8: np.uint16, 4: np.int32, 5: np.int64}[code]
        parts.append(np.fromfile(b, dtype=dtype).astype(np.int64))
    return np.concatenate(parts)


def pytorch_run(a, tok, seed, metrics):
    """The reference: one PyTorch process with the global batch, as dtrain's DDP at W = 2."""
    import torch
    from torch.utils.data.distributed import DistributedSampler
    from gpt_model import GPT, GPTConfig, gpt_loss, init_weights
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    train = torch.from_numpy(read_tokens(os.path.join(tok, "train")))
    val = torch.from_numpy(read_tokens(os.path.join(tok, "val")))
    windows = lambda t: (t.numel() - a.seq_len - 1) // a.seq_len + 1  # noqa: E731
    offsets = torch.arange(a.seq_len + 1)

    def batch(data, idx):
        w = data[(torch.tensor(idx) * a.seq_len).unsqueeze(1) + offsets]
        return w[:, :-1], w[:, 1:]

    model = GPT(GPTConfig(vocab_size=a.vocab_size, seq_len=a.seq_len, layers=a.layers, d_model=a.d_model,
                          heads=a.heads))
    init_weights(model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    glob_batch = 2 * a.batch_size
    sampler = DistributedSampler(range(windows(train)), num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    per_epoch = len(sampler) // glob_batch
    n_eval = min(windows(val) // glob_batch, a.eval_batches) * glob_batch
    epoch, order = -1, None
    with open(metrics, "w") as out:
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            if (step - 1) // per_epoch != epoch:
                epoch = (step - 1) // per_epoch
                sampler.set_epoch(epoch)
                order = list(sampler)
            first = ((step - 1) % per_epoch) * glob_batch
            x, y = batch(train, order[first:first + glob_batch])
            for g in opt.param_groups:
                g["lr"] = a.lr * lr_factor(step, a.warmup, a.steps, a.min_lr / a.lr)
            opt.zero_grad(set_to_none=True)
            loss = gpt_loss(model(x), y)
            loss.backward()
            opt.step()
            rec = {"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                   "step_time_s": time.perf_counter() - t0}
            if step % a.eval_every == 0 or step == a.steps:
                model.eval()
                with torch.no_grad():
                    losses = [gpt_loss(model(vx), vy).item()
                              for vx, vy in (batch(val, list(range(i, i + a.batch_size)))
                                             for i in range(0, n_eval, a.batch_size))]
                model.train()
                rec["val_loss"] = sum(losses) / len(losses)
            out.write(json.dumps(rec) + "\n")


def dtrain_run(a, tok, plan, metrics):
    b = os.path.join(ROOT, "build", "bin")
    cmd = [b + "/dtrun", "--standalone", "--nproc-per-node", "2", b + "/dtrain-gpt"] + plan + [
        "--data", os.path.join(tok, "train"), "--val-data", os.path.join(tok, "val"), "--vocab-size", str(a.vocab_size),
        "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads), "--seq-len", str(a.seq_len),
        "--batch-size", str(a.batch_size), "--global-batch-size", str(2 * a.batch_size), "--steps", str(a.steps),
        "--lr", str(a.lr), "--lr-schedule", "cosine", "--warmup-steps", str(a.warmup), "--min-lr", str(a.min_lr),
        "--eval-every", str(a.eval_every), "--eval-batches", str(a.eval_batches), "--threads", "1", "--seed", "0",
        "--metrics", metrics]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        sys.exit("learning_curve: failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-3000:]))


def curve(metrics, every):
    """(steps, windowed training loss, validation loss) at each evaluation."""
    recs, _ = read_metrics(metrics)
    out = []
    for r in recs:
        if "val_loss" in r:
            window = [q["loss"] for q in recs if r["step"] - every < q["step"] <= r["step"]]
            out.append((r["step"], sum(window) / len(window), r["val_loss"]))
    return out


def svg(curves, path, settle, every):
    w, h, m = 760, 300, 48
    colours = ["#1f77b4", "#d62728", "#7f7f7f", "#2ca02c", "#9467bd"]
    pts = [p for c in curves.values() for p in c]
    x1 = max(p[0] for p in pts)
    lo = min(min(p[1], p[2]) for p in pts if p[0] >= settle)
    hi = max(max(p[1], p[2]) for p in pts if p[0] >= settle)
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    X = lambda s: m + (w / 2 - m - 10) * s / x1  # noqa: E731
    Y = lambda v: h - m + (2 * m - h) * (v - lo) / (hi - lo)  # noqa: E731
    o = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (w, h + 40)]
    for panel, (k, title) in enumerate(((1, "training loss (mean of each %d-step window)" % every), (2, "validation loss"))):
        dx = panel * w / 2
        o.append('<text x="%.0f" y="16">%s</text>' % (dx + m, title))
        o.append('<rect x="%.0f" y="%d" width="%.0f" height="%d" fill="none" stroke="#999"/>' % (dx + m, m, w / 2 - m - 10, h - 2 * m))
        for i in range(5):
            v = lo + (hi - lo) * i / 4
            o.append('<text x="%.0f" y="%.0f" text-anchor="end">%.2f</text>' % (dx + m - 4, Y(v) + 4, v))
        o.append('<text x="%.0f" y="%d" text-anchor="end">step %d</text>' % (dx + w / 2 - 10, h - m + 16, x1))
        for (name, c), col in zip(curves.items(), colours):
            xy = " ".join("%.1f,%.1f" % (dx + X(p[0]), Y(p[k])) for p in c if p[0] >= settle)
            o.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' % (col, xy))
    for i, (name, col) in enumerate(zip(curves, colours)):
        o.append('<rect x="%d" y="%d" width="12" height="3" fill="%s"/><text x="%d" y="%d">%s</text>' %
                 (m + 150 * i, h + 10, col, m + 150 * i + 16, h + 15, name))
    o.append("</svg>")
    open(path, "w").write("\n".join(o) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=10)
    ap.add_argument("--settle", type=int, default=200, help="compare from this step on")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank of 2 (global: twice this)")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    a.settle = min(a.settle, a.steps)
    os.makedirs(a.out, exist_ok=True)
    tok = os.path.join(a.out, "tok")
    if not os.path.exists(os.path.join(tok, "tokenizer.model")):
        corpus = os.path.join(a.out, "corpus")
        os.makedirs(corpus, exist_ok=True)
        files = sorted(glob.glob("/usr/lib/python3.11/*.py"))[:400]  # Python's standard library, 4.7 MB
        with open(os.path.join(corpus, "python.txt"), "wb") as f:
            for p in files:
                f.write(open(p, "rb").read())
        subprocess.run([os.path.join(ROOT, "build", "bin", "dtrain-tokenize"), "--input", corpus, "--output", tok,
                        "--vocab-size", str(a.vocab_size), "--val-fraction", "0.05"], check=True,
                       stdout=subprocess.DEVNULL)
    runs = [("dtrain ddp", lambda m: dtrain_run(a, tok, ["--strategy", "ddp"], m)),
            ("pytorch s0", lambda m: pytorch_run(a, tok, 0, m)),
            ("pytorch s1", lambda m: pytorch_run(a, tok, 1, m)),
            ("dtrain fsdp", lambda m: dtrain_run(a, tok, ["--strategy", "fsdp"], m)),
            ("dtrain pp2", lambda m: dtrain_run(a, tok, ["--pp", "2"], m))]
    curves = {}
    for name, run in runs:
        metrics = os.path.join(a.out, name.replace(" ", "-") + ".jsonl")
        t0 = time.time()
        run(metrics)
        curves[name] = curve(metrics, a.eval_every)
        print("%-12s %4.0f s: final train %.4f, val %.4f" % (name, time.time() - t0, curves[name][-1][1],
                                                             curves[name][-1][2]), flush=True)

    def mad(x, y, k):
        d = [abs(p[k] - q[k]) for p, q in zip(curves[x], curves[y]) if p[0] >= a.settle]
        return sum(d) / len(d), max(d)
    pairs = [("dtrain ddp", "pytorch s0"), ("pytorch s1", "pytorch s0"), ("dtrain fsdp", "dtrain ddp"),
             ("dtrain pp2", "dtrain ddp")]
    summary = {"args": vars(a), "curves": curves, "differences": {}}
    lines = ["| pair | training loss: mean / max difference | validation loss: mean / max difference |",
             "|---|---|---|"]
    for x, y in pairs:
        t, v = mad(x, y, 1), mad(x, y, 2)
        summary["differences"]["%s vs %s" % (x, y)] = {"train": t, "val": v}
        lines.append("| %s vs %s%s | %.4f / %.4f | %.4f / %.4f |" % (x, y, " (the noise)" if x == "pytorch s1" else "",
                                                                 t[0], t[1], v[0], v[1]))
    noise = summary["differences"]["pytorch s1 vs pytorch s0"]
    verdicts = []
    for x, y in pairs:
        if x == "pytorch s1":
            continue
        d = summary["differences"]["%s vs %s" % (x, y)]
        ok = d["train"][0] <= noise["train"][0] and d["val"][0] <= noise["val"][0]
        verdicts.append("%s vs %s: %s" % (x, y, "within the noise" if ok else "OUTSIDE the noise"))
    lines += ["", "Per evaluation (windowed training loss / validation loss):", "",
              "| step | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for i, p in enumerate(curves["dtrain ddp"]):
        lines.append("| %d | " % p[0] + " | ".join("%.4f / %.4f" % (c[i][1], c[i][2]) for c in curves.values()) + " |")
    summary["verdicts"] = verdicts
    json.dump(summary, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    open(os.path.join(a.out, "table.md"), "w").write("\n".join(lines) + "\n\n" + "\n".join(verdicts) + "\n")
    svg(curves, os.path.join(a.out, "learning-curve.svg"), a.eval_every, a.eval_every)
    print("\n".join(lines[:len(pairs) + 2]))
    print("\n".join(verdicts))
    sys.exit(0 if all(v.endswith("within the noise") for v in verdicts) else 1)


if __name__ == "__main__":
    main()
