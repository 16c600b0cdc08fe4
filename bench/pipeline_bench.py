"""Pipeline parallelism (dtrain-gpt --pp): measured idle fraction against the schedule's bubble,
peak memory of 1F1B against GPipe, and tokens/s of PP2 against DDP and FSDP at W = 2.

    /usr/bin/python3 bench/pipeline_bench.py              # everything (about 4 minutes on 2 cores)
    /usr/bin/python3 bench/pipeline_bench.py --part bubble
    /usr/bin/python3 bench/pipeline_bench.py --part limit  # as root: workers in memory cgroups

Peer: none runs here. PyTorch 1.13's pipeline (torch.distributed.pipeline.sync.Pipe) is
single-process over several CUDA devices, and torch.distributed.pipelining (multi-process) came
with 2.4; Debian's python3-torch is 1.13.

Idle fraction (`pipeline_idle` in the metrics, per step): 1 - sum over ranks of the time in
forwards and backwards / (ranks x the slowest rank's pipeline time), median over the timed steps.
The bubble of a schedule is (p-1)/(m+p-1) (1F1B and GPipe; (p-1)/(v m+p-1) interleaved), the idle
fraction of its simulation with a backward twice a forward (build/bin/dtrain-schedule prints it).
On 2 cores, p = 4 runs 4 ranks on 2 cores: their compute times stretch, so the measured fraction is
a lower bound there.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = benchlib.ROOT


def run(world, flags, steps, warmup, limit_mib=0):
    tmp = tempfile.mkdtemp(prefix="dtrain-pp-bench-")
    metrics = os.path.join(tmp, "m.jsonl")
    launch = ["build/bin/dtrun", "--standalone", "--nproc-per-node", str(world), "--allocator", "system",
              "--bind-cores", "off"] if world > 1 else []  # (as the recorded figures ran)
    limit = ["bench/memory_limit.sh", str(limit_mib)] if limit_mib else []
    cmd = launch + limit + ["build/bin/dtrain-gpt", "--threads", "1", "--steps", str(steps), "--metrics", metrics] + flags
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace")
    cgroup_peaks = []
    if limit_mib:
        for d in os.listdir("/sys/fs/cgroup/memory"):  # the workers' cgroups, empty now
            if d.startswith("dtrain-bench-"):
                path = os.path.join("/sys/fs/cgroup/memory", d)
                try:
                    with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
                        cgroup_peaks.append(int(f.read()) / 2**20)
                    os.rmdir(path)
                except OSError:
                    pass
        if res.returncode != 0:
            killed = "SIGKILL" in res.stdout
            return {"cmd": " ".join(cmd), "failed": "killed: over the limit" if killed else
                    "exit %d: %s" % (res.returncode, res.stdout.strip().splitlines()[-1][:200])}
    if res.returncode != 0:
        sys.exit("benchmark command failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-3000:]))
    steps_, final = benchlib.read_metrics(metrics)
    timed = steps_[warmup:]
    out = {"cmd": " ".join(cmd), "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
           "step_ms": 1000 * statistics.median(s["step_time_s"] for s in timed),
           "peak_rss_mib": max(final["peak_rss_mib_per_rank"]), "rss_per_rank": final["peak_rss_mib_per_rank"]}
    if cgroup_peaks:
        out["cgroup_peak_mib"] = max(cgroup_peaks)
    if "pipeline_idle" in timed[0]:
        out["idle"] = statistics.median(s["pipeline_idle"] for s in timed)
    return out


def bubble(p, m, v=1):
    return (p - 1) / (v * m + p - 1)


def part_bubble(a):
    print("\nIdle fraction against the bubble: GPT 4 layers, d_model 128, seq 64, batch 8, %d steps (first %d untimed)"
          % (a.steps, a.warmup))
    print("| p | schedule | m | bubble (p-1)/(vm+p-1) | measured idle | step |")
    print("|---|---|---|---|---|---|")
    model = ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "64", "--batch-size", "8",
             "--global-batch-size", "8", "--strategy", "single"]
    rows = [(2, "1f1b", 1, m) for m in (1, 2, 4, 8)] + [(2, "interleaved", 2, m) for m in (2, 4, 8)] + \
           [(4, "1f1b", 1, m) for m in (1, 2, 4, 8)]
    for p, sched, v, m in rows:
        r = run(p, model + ["--pp", str(p), "--schedule", sched, "--virtual-stages", str(v), "--microbatches", str(m)],
                a.steps, a.warmup)
        print("| %d | %s%s | %d | %.2f | %.2f | %.1f ms |" % (p, sched, " v=%d" % v if v > 1 else "", m,
                                                           bubble(p, m, v), r["idle"], r["step_ms"]), flush=True)


def part_memory(a):
    print("\nPeak RSS per rank, 1F1B against GPipe (p = 2, m = 8): GPT 4 layers, d_model 128, seq 256, batch 32")
    print("| schedule | peak RSS rank 0 | rank 1 | step |")
    print("|---|---|---|---|")
    model = ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "256", "--batch-size", "32",
             "--global-batch-size", "32", "--strategy", "single", "--pp", "2", "--microbatches", "8"]
    res = {}
    for sched in ("gpipe", "1f1b"):
        res[sched] = run(2, model + ["--schedule", sched], max(6, a.steps // 2), 2)
        r = res[sched]
        print("| %s | %.0f MiB | %.0f MiB | %.0f ms |" % (sched, r["rss_per_rank"][0], r["rss_per_rank"][1], r["step_ms"]),
              flush=True)
    print("1F1B / GPipe peak RSS on rank 0: %.2f" % (res["1f1b"]["rss_per_rank"][0] / res["gpipe"]["rss_per_rank"][0]))


def part_speed(a):
    print("\nTokens/s at W = 2, the demo model (4 layers, d_model 128, seq 128), global batch 16, %d steps" % a.steps)
    print("| strategy | tokens/s | step | peak RSS/rank | vs DDP |")
    print("|---|---|---|---|---|")
    model = ["--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "128"]
    runs = [("ddp", ["--strategy", "ddp", "--batch-size", "8"]),
            ("fsdp", ["--strategy", "fsdp", "--batch-size", "8"]),
            ("pp2 1f1b m=4", ["--strategy", "single", "--pp", "2", "--batch-size", "16", "--global-batch-size", "16",
                              "--microbatches", "4"]),
            ("pp2 1f1b m=8", ["--strategy", "single", "--pp", "2", "--batch-size", "16", "--global-batch-size", "16",
                              "--microbatches", "8"])]
    res = {}
    for name, flags in runs:
        res[name] = run(2, model + flags, a.steps, a.warmup)
        r = res[name]
        print("| %s | %.0f | %.1f ms | %.0f MiB | %.2f |" % (name, r["tokens_per_s"], r["step_ms"], r["peak_rss_mib"],
                                                           r["tokens_per_s"] / res["ddp"]["tokens_per_s"]), flush=True)


def part_limit(a):
    lim = a.limit_mib
    print("\nA model whose fp32 Adam state does not fit with DDP: GPT 8 layers, d_model 512, seq 64 (25.5M parameters:"
          " 97 MiB of parameters, 195 MiB of Adam state), W = 2, global batch 8, %d steps; each worker in a memory"
          " cgroup of its own limited to %d MiB (bench/memory_limit.sh, root). The cgroup counts the memory a worker"
          " charges (its own pages, not the shared libraries' already in the page cache): its peak is what the limit"
          " applies to; peak RSS (with those libraries) is measured in a run without the limit"
          % (max(4, a.steps // 2), lim))
    print("| strategy | peak RSS/rank (no limit) | under %d MiB | cgroup peak | tokens/s | vs FSDP |" % lim)
    print("|---|---|---|---|---|---|")
    model = ["--layers", "8", "--d-model", "512", "--heads", "8", "--seq-len", "64"]
    runs = [("fsdp", ["--strategy", "fsdp", "--batch-size", "4"]),
            ("ddp", ["--strategy", "ddp", "--batch-size", "4"]),
            ("zero1", ["--strategy", "zero1", "--batch-size", "4"]),
            ("pp2 1f1b m=4", ["--strategy", "single", "--pp", "2", "--batch-size", "8", "--global-batch-size", "8",
                              "--microbatches", "4"])]
    steps, warmup = max(4, a.steps // 2), 2
    res = {}
    for name, flags in runs:
        free = run(2, model + flags, 3, 1)
        limited = run(2, model + flags, steps, warmup, limit_mib=lim)
        res[name] = limited
        ran = "failed" not in limited
        fsdp = res.get("fsdp", {})
        ratio = "%.2f" % (limited["tokens_per_s"] / fsdp["tokens_per_s"]) if ran and "tokens_per_s" in fsdp else "-"
        print("| %s | %.0f MiB | %s | %s | %s | %s |" % (
            name, free["peak_rss_mib"], "runs" if ran else limited["failed"],
            "%.0f MiB" % limited["cgroup_peak_mib"] if ran and "cgroup_peak_mib" in limited else "-",
            "%.0f" % limited["tokens_per_s"] if ran else "-", ratio), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "bubble", "memory", "speed", "limit"], default="all")
    ap.add_argument("--limit-mib", type=int, default=500, help="--part limit: memory per worker")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    a = ap.parse_args()
    print("pipeline bench: BLAS %s, 1 intra-op thread per rank, %d cores" % (benchlib.blas_name(), os.cpu_count()))
    if a.part in ("all", "bubble"):
        part_bubble(a)
    if a.part in ("all", "memory"):
        part_memory(a)
    if a.part in ("all", "speed"):
        part_speed(a)
    if a.part in ("all", "limit"):
        if os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/memory"):
            print("\n--part limit needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory): skipped")
        else:
            part_limit(a)


if __name__ == "__main__":
    main()
