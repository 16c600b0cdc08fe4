"""dtrain against PyTorch on the GPUs of one machine, in one command (scripts/gpu-check.sh --bench).

For each model shape: dtrain-gpt single / ddp / fsdp (under dtrun, --device cuda --precision bf16)
against PyTorch single / DDP / FSDP2 fully_shard (bench/gpu_peer.py under torch.distributed.run),
both with fused attention (scaled_dot_product_attention), AdamW, the same data and batch, every
GPU of the machine for the distributed ones (single: one GPU). Runs alternate; the table gives
the median step time over the timed steps of every repeat, tokens/s, MFU and the peak GPU memory
(the caching allocator's max allocated, max over ranks), and dtrain / PyTorch ratios.

MFU = tokens/s x FLOPs per token / (GPUs x peak), FLOPs per token = 6 x (matmul parameters:
everything but the two embeddings) + 12 x layers x d_model x seq_len (forward + backward,
attention's causal half not discounted), as GPTImpl::flops_per_token; the peak is the GPU's dense
bf16 figure (--peak-tflops, default by name as dtrain::util::known_peak_tflops).

  python3 bench/gpu_bench.py                       # the 151M and 805M shapes, 30 steps, 2 repeats
  python3 bench/gpu_bench.py --shapes 151m --steps 20 --out bench/results/gpu.json
  python3 bench/gpu_bench.py --device cpu --shapes tiny --steps 6 --warmup 2 --repeats 1
                                                   # smoke test of the plumbing on a CPU machine
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import read_metrics  # noqa: E402
from profile_summary import digest, load as load_profile, print_side_by_side  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (layers, d_model, heads, seq_len, batch per rank)
SHAPES = {
    "tiny": (2, 64, 4, 64, 4),
    "151m": (12, 1024, 16, 1024, 8),
    "805m": (16, 2048, 16, 1024, 8),
}

# Dense bf16/fp16 tensor-core peaks (TFLOP/s), most specific names first (dtrain::util::known_peak_tflops).
PEAKS = [("GB200", 2250.0), ("B200", 2250.0), ("H200", 989.4), ("H100 PCIe", 756.5), ("H100", 989.4),
         ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("A10G", 70.0), ("L4", 121.0)]


def flops_per_token(layers, d, seq, vocab=256, mlp=4):
    per_block = (3 * d * d + 3 * d) + (d * d + d) + 4 * d + (mlp * d * d + mlp * d) + (mlp * d * d + d)
    return 6.0 * (layers * per_block + 2 * d + vocab * d) + 12.0 * layers * d * seq


def gpus():
    """(count, name) of this machine's CUDA devices through the PyTorch that runs the peer."""
    code = "import torch; n = torch.cuda.device_count(); print(n); print(torch.cuda.get_device_name(0) if n else '')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    return int(out[0]), out[1].strip()


def peak_of(name):
    for key, tflops in PEAKS:
        if key in name:
            return tflops
    return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shapes", default="151m,805m", help="comma-separated: " + ", ".join(SHAPES))
    ap.add_argument("--world", type=int, default=0, help="ranks for ddp/fsdp (default: every GPU; 2 on the CPU)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak (default: known GPUs by name)")
    ap.add_argument("--only", default="", help="comma-separated contenders to run (default all)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--profile", action="store_true", help="kernel profiles of steps 3-4 of each contender's first "
                    "repeat (DTRAIN_PROFILE / gpu_peer.py --profile), compared side by side and kept in --out")
    a = ap.parse_args()
    if a.warmup >= a.steps:
        sys.exit("gpu_bench: --warmup (%d) must be below --steps (%d)" % (a.warmup, a.steps))
    if a.profile and a.warmup < 4:
        sys.exit("gpu_bench: --profile profiles steps 3-4, inside the untimed ones: needs --warmup 4 or more")
    for s in a.shapes.split(","):
        if s not in SHAPES:
            sys.exit("gpu_bench: unknown shape '%s' (known: %s)" % (s, ", ".join(SHAPES)))

    cuda = a.device == "cuda"
    if cuda:
        n, gpu = gpus()
        if n == 0:
            sys.exit("gpu_bench: no CUDA device visible to %s (use --device cpu for the smoke test)" % sys.executable)
    else:
        n, gpu = 2, "cpu"
    world = a.world or n
    peak = a.peak_tflops or peak_of(gpu)
    for exe in ("build-gpu/bin/dtrain-gpt", "build/bin/dtrain-gpt"):
        if os.path.exists(os.path.join(ROOT, exe)):
            bindir = os.path.dirname(exe)
            break
    else:
        sys.exit("gpu_bench: no dtrain-gpt under build-gpu/bin or build/bin (scripts/gpu-check.sh or scripts/build.sh)")

    precision = ["--precision", "bf16"]
    dev = ["--device", a.device]
    contenders = [
        ("dtrain single", 1, lambda m, f: [bindir + "/dtrain-gpt", "--strategy", "single"] + dev + precision + f + ["--metrics", m]),
        ("dtrain ddp", world, lambda m, f: [bindir + "/dtrun", "--standalone", "--nproc-per-node", str(world),
                                            bindir + "/dtrain-gpt", "--strategy", "ddp"] + dev + precision + f + ["--metrics", m]),
        ("dtrain fsdp", world, lambda m, f: [bindir + "/dtrun", "--standalone", "--nproc-per-node", str(world),
                                             bindir + "/dtrain-gpt", "--strategy", "fsdp"] + dev + precision + f + ["--metrics", m]),
        ("pytorch single", 1, lambda m, f: [sys.executable, "bench/gpu_peer.py", "--strategy", "single"] + dev + precision + f + ["--metrics", m]),
        ("pytorch ddp", world, lambda m, f: [sys.executable, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1", "--standalone", "--nproc_per_node",
                                             str(world), "bench/gpu_peer.py", "--strategy", "ddp"] + dev + precision + f + ["--metrics", m]),
        ("pytorch fsdp2", world, lambda m, f: [sys.executable, "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1", "--standalone", "--nproc_per_node",
                                               str(world), "bench/gpu_peer.py", "--strategy", "fsdp2"] + dev + precision + f + ["--metrics", m]),
    ]
    if a.only:
        wanted = set(a.only.split(","))
        contenders = [c for c in contenders if c[0] in wanted]

    import platform
    print("gpu_bench: %s x %d (%s), peak %s TFLOP/s bf16 dense, %s, %d steps (first %d untimed), %d repeat(s)" %
          (gpu, n, a.device, ("%.1f" % peak) if peak else "unknown", platform.node(), a.steps, a.warmup, a.repeats),
          flush=True)
    tmp = tempfile.mkdtemp(prefix="dtrain-gpu-bench-")
    env = dict(os.environ)
    if not cuda:
        env["OMP_NUM_THREADS"] = "1"
    results = {}
    for shape in a.shapes.split(","):
        layers, d, heads, seq, batch = SHAPES[shape]
        flags = ["--layers", str(layers), "--d-model", str(d), "--heads", str(heads), "--seq-len", str(seq),
                 "--batch-size", str(batch), "--steps", str(a.steps), "--threads", "1"]
        fpt = flops_per_token(layers, d, seq)
        runs = {name: [] for name, _, _ in contenders}
        notes = {}
        profiles = {}
        for rep in range(a.repeats):
            for name, ranks, make in contenders:
                if name in notes:
                    continue
                metrics = os.path.join(tmp, "%s-%s-%d.jsonl" % (shape, name.replace(" ", "-"), rep))
                cmd = make(metrics, flags)
                run_env = env
                if a.profile and rep == 0:
                    profiles[name] = metrics[:-len(".jsonl")] + ".profile.json"
                    if name.startswith("dtrain"):
                        run_env = dict(env, DTRAIN_PROFILE=profiles[name] + "@3:4")
                    else:
                        cmd = cmd + ["--profile", profiles[name] + "@3:4"]
                res = subprocess.run(cmd, cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if res.returncode != 0 or not os.path.exists(metrics):
                    lines = [l for l in res.stdout.strip().splitlines() if l.strip() and not set(l.strip()) <= set("=-")]
                    why = [l for l in lines if "gpu_peer:" in l or "error:" in l] or lines[-1:] or ["(no output)"]
                    notes[name] = "failed (exit %d): %s" % (res.returncode, why[0].strip()[:160])
                    print("  %-5s %-15s %s" % (shape, name, notes[name]), flush=True)
                    continue
                steps, final = read_metrics(metrics)
                timed = [s["step_time_s"] for s in steps[a.warmup:]]
                runs[name].append({"step_s": statistics.median(timed), "ranks": ranks,
                                   "gpu_mib": final.get("peak_gpu_mib", float("nan")), "first_loss": steps[0]["loss"],
                                   # host-side phase times where the contender reports them (dtrain's metrics)
                                   "parts_ms": {k: 1000 * statistics.median(s[k] for s in steps[a.warmup:])
                                                for k in ("forward_s", "backward_s", "optimizer_s") if k in steps[-1]}})
                print("  %-5s %-15s run %d: median step %8.1f ms %s" % (
                    shape, name, rep + 1, 1000 * runs[name][-1]["step_s"],
                    " ".join("%s %.1f" % (k, v) for k, v in runs[name][-1]["parts_ms"].items())), flush=True)
        rows = {}
        for name, ranks, _ in contenders:
            rs = runs[name]
            if not rs:
                rows[name] = {"note": notes.get(name, "no run")}
                continue
            step_s = statistics.median(r["step_s"] for r in rs)
            tokens = batch * seq * ranks / step_s
            rows[name] = {"ranks": ranks, "step_ms": 1000 * step_s, "tokens_per_s": tokens,
                          "mfu": tokens * fpt / (ranks * peak * 1e12) if peak else None,
                          "peak_gpu_mib": statistics.median(r["gpu_mib"] for r in rs), "first_loss": rs[0]["first_loss"],
                          "parts_ms": rs[0]["parts_ms"]}
        results[shape] = {"layers": layers, "d_model": d, "heads": heads, "seq_len": seq, "batch_per_rank": batch,
                          "flops_per_token": fpt, "rows": rows}
        loaded = {name: load_profile(path) for name, path in profiles.items()}
        digests = {name: digest(p) for name, p in loaded.items() if p is not None}
        if digests:
            results[shape]["profiles"] = digests
        print()
        print("%s: %d layers, d_model %d, %d heads, seq %d, batch %d per rank, %.3f GFLOP/token" %
              (shape, layers, d, heads, seq, batch, fpt / 1e9))
        print("| contender | ranks | median step ms | tokens/s | MFU | peak GPU MiB |")
        print("|---|---|---|---|---|---|")
        for name, r in rows.items():
            if "note" in r:
                print("| %s | | %s | | | |" % (name, r["note"]))
                continue
            print("| %s | %d | %.1f | %.0f | %s | %s |" % (
                name, r["ranks"], r["step_ms"], r["tokens_per_s"], "%.1f%%" % (100 * r["mfu"]) if r["mfu"] else "n/a",
                "%.0f" % r["peak_gpu_mib"] if r["peak_gpu_mib"] == r["peak_gpu_mib"] else "n/a"))
        for ours, theirs in (("dtrain single", "pytorch single"), ("dtrain ddp", "pytorch ddp"), ("dtrain fsdp", "pytorch fsdp2")):
            if "step_ms" in rows.get(ours, {}) and "step_ms" in rows.get(theirs, {}):
                print("%s / %s: tokens/s %.2fx, first loss %.4f vs %.4f" % (
                    ours, theirs, rows[ours]["tokens_per_s"] / rows[theirs]["tokens_per_s"],
                    rows[ours]["first_loss"], rows[theirs]["first_loss"]))
            if ours in digests and theirs in digests:
                print_side_by_side(ours, digests[ours], theirs, digests[theirs])
        print(flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"gpu": gpu, "gpus": n, "peak_tflops": peak, "args": vars(a), "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
