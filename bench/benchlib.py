"""Shared pieces of the side-by-side benchmarks: run dtrain-gpt (under dtrun) and the PyTorch peer
(bench/gpt_ddp.py under torch.distributed.run) on the same model, data and batch, alternately,
and summarise their metrics files. Uses only the standard library (Debian's /usr/bin/python3)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def common_args(description):
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return ap


def model_flags(a):
    return ["--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
            "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--steps", str(a.steps),
            "--threads", str(a.threads)]


def dtrain_cmd(a, strategy, metrics, extra=()):
    # (--allocator system --bind-cores off: as the PyTorch peer runs under torchrun, and as the
    # recorded figures ran; bench/allocator_bench.py measures what dtrun's defaults change)
    return ["build/bin/dtrun", "--standalone", "--nproc-per-node", str(a.world), "--allocator", "system",
            "--bind-cores", "off", "build/bin/dtrain-gpt",
            "--strategy", strategy] + model_flags(a) + ["--metrics", metrics] + list(extra)


def pytorch_cmd(a, metrics, extra=()):
    return ["/usr/bin/python3", "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1", "--standalone",
            "--nproc_per_node", str(a.world), "bench/gpt_ddp.py"] + model_flags(a) + ["--metrics", metrics] + list(extra)


def blas_name():
    try:
        return os.path.basename(os.path.dirname(os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")))
    except OSError:
        return "unknown"


def read_run(path):
    """A --metrics file as (start, steps, final): the record that describes the run, the training
    steps' records, the final record (None where missing)."""
    start, steps, final = None, [], None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("final"):
                final = rec
            elif "step" in rec and "loss" in rec:  # (evaluations have no loss)
                steps.append(rec)
            elif rec.get("start"):
                start = rec
    return start, steps, final


def read_metrics(path):
    _, steps, final = read_run(path)
    return steps, final


def run_all(a, contenders):
    """contenders: list of (name, function(metrics_path) -> argv). Runs each a.repeats times,
    alternating, and returns {name: summary}."""
    tmp = tempfile.mkdtemp(prefix="dtrain-bench-")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    runs = {name: [] for name, _ in contenders}
    for rep in range(a.repeats):
        for name, make_cmd in contenders:
            metrics = os.path.join(tmp, "%s-%d.jsonl" % (name, rep))
            cmd = make_cmd(metrics)
            res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if res.returncode != 0:
                sys.exit("benchmark command failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-4000:]))
            steps, final = read_metrics(metrics)
            run = {"step_time_s": statistics.median(s["step_time_s"] for s in steps[a.warmup:]),
                   "peak_rss_mib": max(final["peak_rss_mib_per_rank"]),
                   "optimizer_state_mib": max(final.get("optimizer_state_mib_per_rank", [float("nan")])),
                   "losses": [s["loss"] for s in steps]}
            runs[name].append(run)
            print("  run %d %-14s median step %6.1f ms, peak RSS %4.0f MiB" %
                  (rep + 1, name, 1000 * run["step_time_s"], run["peak_rss_mib"]), flush=True)
    summary = {}
    for name, rs in runs.items():
        summary[name] = {"step_time_ms": 1000 * statistics.median(r["step_time_s"] for r in rs),
                         "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                         "optimizer_state_mib": statistics.median(r["optimizer_state_mib"] for r in rs),
                         "first_losses": rs[0]["losses"][:3]}
    return summary, runs


def same_work(summary, a_name, b_name):
    x, y = summary[a_name]["first_losses"], summary[b_name]["first_losses"]
    return max(abs(p - q) / abs(q) for p, q in zip(x, y))


def header(a, title):
    print()
    print("%s: world %d, %d thread(s) per rank, BLAS %s, GPT %d layers d_model %d, batch %d x %d per rank, "
          "%d steps (first %d untimed), %d repeats" % (title, a.world, a.threads, blas_name(), a.layers, a.d_model,
                                                       a.batch_size, a.seq_len, a.steps, a.warmup, a.repeats))


def write_json(a, payload):
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(payload, args=vars(a), blas=blas_name()), f, indent=1)
