#!/usr/bin/env python3
"""Peak RSS and tokens/s of each strategy under each allocator dtrun can preload (issue 32; Design
note [the workers' allocator], include/dtrain/launch/allocator.h), with ranks bound to cores and
not. One run per cell, the cells interleaved per repeat; prints a table and writes JSON.

  python3 bench/allocator_bench.py --world 2 --out bench/results/allocators-w2.json

The model defaults to issue 32's state-heavy GPT (8 layers, d_model 256, T 32, batch 2, 1 thread):
its model state dwarfs its activations, so what a strategy saves is mostly state. Each run's
final record gives the peak RSS per rank and the counted tensor peak per rank (util/memory.h)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import read_run  # noqa: E402


def run(a, strategy, allocator, bind, metrics):
    cmd = ["build/bin/dtrun", "--standalone", "--nproc-per-node", str(a.world), "--allocator", allocator,
           "--bind-cores", bind, "build/bin/dtrain-gpt", "--strategy", strategy, "--layers", str(a.layers),
           "--d-model", str(a.d_model), "--heads", str(a.heads), "--seq-len", str(a.seq_len),
           "--batch-size", str(a.batch_size), "--steps", str(a.steps), "--threads", str(a.threads), "--metrics", metrics]
    res = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        sys.exit("failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-3000:]))
    start, steps, final = read_run(metrics)
    timed = steps[a.warmup:]
    tokens = sum(s["tokens_per_s"] * s["step_time_s"] for s in timed) / sum(s["step_time_s"] for s in timed)
    return {"peak_rss_mib": max(final["peak_rss_mib_per_rank"]), "peak_tensor_mib": max(final["peak_tensor_mib_per_rank"]),
            "tokens_per_s": tokens, "allocator_seen": start.get("allocator", "?"), "first_loss": steps[0]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--strategies", default="ddp,zero1,zero2,fsdp")
    ap.add_argument("--allocators", default="system,tcmalloc,jemalloc")
    ap.add_argument("--bind", default="off,on", help="--bind-cores settings to run")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dtrain-alloc-")
    cells = [(s, al, b) for b in a.bind.split(",") for al in a.allocators.split(",") for s in a.strategies.split(",")]
    results = {c: [] for c in cells}
    for rep in range(a.repeats):
        for c in cells:
            r = run(a, *c, os.path.join(tmp, "%s-%s-%s-%d.jsonl" % (c + (rep,))))
            results[c].append(r)
            print("  %-6s %-9s bind %-3s  RSS %5.0f MiB  tensors %5.1f MiB  %6.0f tok/s  (worker saw %s)" %
                  (c[0], c[1], c[2], r["peak_rss_mib"], r["peak_tensor_mib"], r["tokens_per_s"], r["allocator_seen"]), flush=True)
    table = []
    for (s, al, b), rs in results.items():
        table.append({"strategy": s, "allocator": al, "bind_cores": b,
                      "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                      "peak_tensor_mib": statistics.median(r["peak_tensor_mib"] for r in rs),
                      "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs)})
    print("\nW = %d, %d layers, d_model %d, T %d, batch %d, %d thread(s), %d steps (first %d untimed), %d repeat(s)" %
          (a.world, a.layers, a.d_model, a.seq_len, a.batch_size, a.threads, a.steps, a.warmup, a.repeats))
    print("| bind | allocator | " + " | ".join("%s RSS (tensors) MiB, tok/s" % s for s in a.strategies.split(",")) +
          " | fsdp/ddp RSS | share of the counted saving in RSS |")
    for b in a.bind.split(","):
        for al in a.allocators.split(","):
            row = {t["strategy"]: t for t in table if t["allocator"] == al and t["bind_cores"] == b}
            cells_txt = ["%.0f (%.1f), %.0f" % (row[s]["peak_rss_mib"], row[s]["peak_tensor_mib"], row[s]["tokens_per_s"])
                         for s in a.strategies.split(",")]
            extra = ""
            if "ddp" in row and "fsdp" in row:
                d, f = row["ddp"], row["fsdp"]
                counted = d["peak_tensor_mib"] - f["peak_tensor_mib"]
                share = (d["peak_rss_mib"] - f["peak_rss_mib"]) / counted if counted > 0 else float("nan")
                extra = " | %.2f | %.0f%%" % (f["peak_rss_mib"] / d["peak_rss_mib"], 100 * share)
            print("| %s | %s | %s%s |" % (b, al, " | ".join(cells_txt), extra))
    if a.out:
        with open(os.path.join(ROOT, a.out) if not os.path.isabs(a.out) else a.out, "w") as f:
            json.dump({"args": vars(a), "table": table,
                       "runs": {"/".join(c): rs for c, rs in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
