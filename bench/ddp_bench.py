#!/usr/bin/python3
"""dtrain DDP vs PyTorch's Python DDP: the same GPT (same initial weights), data, data order, batch
and optimizer; world size 2, one intra-op thread per rank, Gloo over loopback; run alternately in
one invocation. Prints the median step time and peak RSS per rank of each, and the ratios.

    /usr/bin/python3 bench/ddp_bench.py                 # after scripts/build.sh
    /usr/bin/python3 bench/ddp_bench.py --d-model 256 --repeats 5 --out bench/results/ddp.json

Uses Debian's python3-torch (1.13) for the peer; dtrain's side is build/bin/dtrun + dtrain-gpt.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_metrics(path):
    steps, final = [], None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("final"):
                final = rec
            else:
                steps.append(rec)
    return steps, final


def run(cmd, env=None):
    res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        sys.exit("benchmark command failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-4000:]))


def blas_name():
    try:
        return os.path.basename(os.path.dirname(os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")))
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    a = ap.parse_args()

    model = ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
             "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
             "--threads", str(a.threads)]
    tmp = tempfile.mkdtemp(prefix="dtrain-bench-")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    results = {"dtrain": [], "pytorch": []}
    for rep in range(a.repeats):
        for name in ("dtrain", "pytorch"):
            metrics = os.path.join(tmp, "%s-%d.jsonl" % (name, rep))
            if name == "dtrain":
                cmd = ["build/bin/dtrun", "--standalone", "--nproc-per-node", str(a.world),
                       "build/bin/dtrain-gpt", "--strategy", "ddp"] + model + ["--metrics", metrics]
            else:
                cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1",
                       "--standalone", "--nproc_per_node", str(a.world), "bench/gpt_ddp.py"] + model + \
                      ["--metrics", metrics]
            run(cmd, env)
            steps, final = read_metrics(metrics)
            times = [s["step_time_s"] for s in steps[a.warmup:]]
            results[name].append({"step_time_s": statistics.median(times),
                                  "peak_rss_mib": max(final["peak_rss_mib_per_rank"]),
                                  "losses": [s["loss"] for s in steps],
                                  "param_checksum": final["param_checksum"]})
            print("  run %d %-8s median step %.1f ms, peak RSS %.0f MiB" %
                  (rep + 1, name, 1000 * results[name][-1]["step_time_s"], results[name][-1]["peak_rss_mib"]),
                  flush=True)

    d, p = results["dtrain"][0], results["pytorch"][0]
    same_work = max(abs(x - y) / abs(y) for x, y in zip(d["losses"][:3], p["losses"][:3]))
    summary = {}
    for name in results:
        summary[name] = {"step_time_ms": 1000 * statistics.median(r["step_time_s"] for r in results[name]),
                         "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in results[name])}
    ratio_time = summary["dtrain"]["step_time_ms"] / summary["pytorch"]["step_time_ms"]
    ratio_rss = summary["dtrain"]["peak_rss_mib"] / summary["pytorch"]["peak_rss_mib"]
    print()
    print("DDP benchmark: world %d, %d thread(s) per rank, BLAS %s, GPT %d layers d_model %d, "
          "batch %d x %d per rank, %d steps (first %d untimed), %d repeats" %
          (a.world, a.threads, blas_name(), a.layers, a.d_model, a.batch_size, a.seq_len, a.steps, a.warmup,
           a.repeats))
    print("same work: first 3 losses agree to %.1e (relative)" % same_work)
    print("%-22s %14s %16s" % ("", "step time (ms)", "peak RSS/rank (MiB)"))
    for name, label in (("dtrain", "dtrain DDP (C++)"), ("pytorch", "PyTorch DDP (Python)")):
        print("%-22s %14.1f %16.0f" % (label, summary[name]["step_time_ms"], summary[name]["peak_rss_mib"]))
    print("%-22s %14.2f %16.2f" % ("ratio dtrain/PyTorch", ratio_time, ratio_rss))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "blas": blas_name(), "summary": summary,
                       "ratio_step_time": ratio_time, "ratio_peak_rss": ratio_rss, "same_work_rel": same_work,
                       "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
