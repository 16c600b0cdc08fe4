"""What a checkpoint costs the step: synchronous saves against --save-async (issue 29).

The state-heavy GPT (25.5M parameters, AdamW; 292 MB per checkpoint at W = 2 under FSDP) trained by
`dtrun --nproc-per-node 2 dtrain-gpt --strategy fsdp` three ways, one after another:

  none    no checkpoints (the steps' own time)
  snapshot --snapshot-every 1: each rank's state into its partner's memory every step
  snap2   --snapshot-every 2: the same every other step, to compare the steps in one run
  sync    --save-every K: each save stops every rank until its files are committed
  async   --save-every K --save-async: the state is copied to host buffers, written in the background

From the metrics: each save's stall (checkpoint_stall_s: what the save step waited, plus the
next step's checkpoint_copy_wait_s: what its optimizer step waited for the background copy of the
parameters and optimizer state; Design note [a copy overlapped with the next step]), the background
write's time (checkpoint_write_s) and its thread's CPU time (checkpoint_write_cpu_s: what the writer
costs the cores), the rank's bytes, and the median step time of the steps that ran
while a background write was in flight against the no-checkpoint run's median. The stall is set
against this machine's memory-copy bandwidth (a 256 MiB torch copy in each of two processes at once,
as the two ranks copy at once; measured here), as the issue's bound: stall <= 1.2 x bytes /
bandwidth + 50 ms. A snapshot's cost: what it held its step (snapshot_s and the next step's copy
wait) plus how much longer the steps with its background exchange in flight ran than the same run's
other steps (--snapshot-every 2: every other step has one).

  /usr/bin/python3 bench/checkpoint_bench.py --layers 11 --steps 24 --save-every 4 --async-steps 40   # ~17 minutes
  /usr/bin/python3 bench/checkpoint_bench.py --steps 12 --save-every 4 --layers 2 --d-model 128   # plumbing
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from benchlib import read_metrics  # noqa: E402


COPY = """
import sys, time, torch
torch.set_num_threads(1)
src = torch.ones(64 << 20)  # 256 MiB
dst = torch.empty_like(src)
dst.copy_(src)
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    dst.copy_(src)
    best = min(best, time.perf_counter() - t0)
print(src.numel() * 4 / best)
"""


def copy_bandwidth(procs):
    """Bytes per second of one large host-memory copy (torch's copy_, as the saver's) in each of
    `procs` processes copying at once (the ranks of a machine copy their state at the same time)."""
    ps = [subprocess.Popen([sys.executable, "-c", COPY], stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    return min(float(p.communicate()[0]) for p in ps)


def run(a, extra, metrics, steps=0):
    b = os.path.join(ROOT, "build", "bin")
    cmd = [b + "/dtrun", "--standalone", "--nproc-per-node", "2", b + "/dtrain-gpt", "--strategy", "fsdp",
           "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads), "--seq-len", "32",
           "--batch-size", "2", "--steps", str(steps or a.steps), "--threads", "1", "--metrics", metrics] + extra
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        sys.exit("checkpoint_bench: failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-3000:]))
    return read_metrics(metrics)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--save-every", type=int, default=8)
    ap.add_argument("--async-steps", type=int, default=0,
                    help="steps of the --save-async run (default --steps): more saves, more samples of the steps "
                         "with a write in flight (step times vary by +-10%% here)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--snapshot-cost-only", action="store_true",
                    help="only the --snapshot-every 2 run (--steps of it) and the snapshot's cost per step")
    a = ap.parse_args()
    if a.snapshot_cost_only:
        return snapshot_cost_only(a)
    tmp = tempfile.mkdtemp(prefix="dtrain-ckpt-bench-")
    bw1, bw = copy_bandwidth(1), copy_bandwidth(2)
    none = run(a, [], os.path.join(tmp, "none.jsonl"))
    sync = run(a, ["--save", os.path.join(tmp, "sync"), "--save-every", str(a.save_every)], os.path.join(tmp, "sync.jsonl"))
    asyn = run(a, ["--save", os.path.join(tmp, "async"), "--save-every", str(a.save_every), "--save-async"],
               os.path.join(tmp, "async.jsonl"), a.async_steps)
    snap = run(a, ["--snapshot-every", "1"], os.path.join(tmp, "snapshot.jsonl"))
    snap2 = run(a, ["--snapshot-every", "2"], os.path.join(tmp, "snapshot2.jsonl"))
    snap_s = statistics.median(r["snapshot_s"] + r.get("checkpoint_copy_wait_s", 0) for r in snap[2:] if "snapshot_s" in r)
    base = statistics.median(r["step_time_s"] for r in none[2:])
    # --snapshot-every 2: the steps after a snapshot (its exchange in flight) against the others.
    held, after, other = snapshot_cost(snap2)
    snap_cost = held + statistics.median(after) - statistics.median(other)
    sync_stall = [r["checkpoint_stall_s"] for r in sync if "checkpoint_stall_s" in r]
    by_step = {r["step"]: r for r in asyn if "step" in r}
    async_stall = [r["checkpoint_stall_s"] + by_step.get(r["step"] + 1, {}).get("checkpoint_copy_wait_s", 0)
                   for r in asyn if "checkpoint_stall_s" in r]
    writes = [r["checkpoint_write_s"] for r in asyn if "checkpoint_write_s" in r]
    write_cpu = [r["checkpoint_write_cpu_s"] for r in asyn if "checkpoint_write_cpu_s" in r]
    mib = max(r["checkpoint_mib"] for r in asyn if "checkpoint_mib" in r)
    # Steps with a write in flight: after a save step, until the record that reports its end.
    during, without, in_flight = [], [], False
    for r in asyn:
        if in_flight and "checkpoint_stall_s" not in r:
            during.append(r["step_time_s"])
        elif "checkpoint_stall_s" not in r and "step_time_s" in r and r["step"] > 2:
            without.append(r["step_time_s"])  # (the same run's steps with no write in flight)
        if "checkpoint_write_s" in r:
            in_flight = False
        if "checkpoint_stall_s" in r:
            in_flight = True
    bound = 1.2 * mib * 1048576 / bw + 0.05
    result = {
        "args": vars(a), "copy_gb_per_s_one_process": bw1 / 1e9, "copy_gb_per_s_each_of_two": bw / 1e9, "rank_mib": mib, "step_s_no_checkpoints": base,
        "sync_stall_s": sync_stall, "async_stall_s": async_stall, "async_write_s": writes,
        "async_write_cpu_s": write_cpu,
        "step_s_during_background_write": statistics.median(during) if during else None,
        "steps_during_background_write": len(during), "stall_bound_s": bound,
        "step_s_same_run_no_write": statistics.median(without) if without else None,
        "snapshot_s": snap_s, "step_s_with_snapshot_every_step": statistics.median(r["step_time_s"] for r in snap[2:]),
        "snapshot_every_2_held_s": held, "snapshot_every_2_step_s_after": statistics.median(after),
        "snapshot_every_2_step_s_other": statistics.median(other), "snapshot_cost_s": snap_cost,
    }
    print("host copy %.2f GB/s alone, %.2f GB/s each of two at once; each rank writes %.1f MiB per checkpoint; "
          "a step without checkpoints %.3f s" % (bw1 / 1e9, bw / 1e9, mib, base))
    print("| | stall per save (median) | background write (median) |")
    print("|---|---|---|")
    print("| synchronous | %.3f s | - |" % statistics.median(sync_stall))
    print("| --save-async | %.3f s | %.3f s |" % (statistics.median(async_stall), statistics.median(writes) if writes else float("nan")))
    print("async stall / sync stall: %.3f; bound 1.2 x bytes / copy bandwidth + 50 ms = %.3f s: %s" % (
        statistics.median(async_stall) / statistics.median(sync_stall), bound,
        "within" if max(async_stall) <= bound else "OVER (max %.3f s)" % max(async_stall)))
    if during:
        print("steps while a write is in flight: %d, median %.3f s = %.2fx the step without checkpoints "
              "(tokens/s ratio %.2f)" % (len(during), statistics.median(during), statistics.median(during) / base,
                                        base / statistics.median(during)))
    if write_cpu:
        print("the writer thread's CPU time per save (rank 0): median %.3f s (%s)" % (
            statistics.median(write_cpu), ", ".join("%.2f" % c for c in write_cpu)))
    if during and without:
        print("the same run's steps with no write in flight: %d, median %.3f s; tokens/s while writing / without: %.2f"
              % (len(without), statistics.median(without), statistics.median(without) / statistics.median(during)))
    print("a partner snapshot every step: held the step %.3f s (median) = %.1f%% of the step without checkpoints; "
          "steps with one every step %.3f s (+ held) against %.3f s without (another run)" %
          (snap_s, 100 * snap_s / base, result["step_s_with_snapshot_every_step"], base))
    print("--snapshot-every 2, one run: held %.3f s; steps with the exchange in flight %.3f s, the others %.3f s: "
          "a snapshot costs %.3f s = %.1f%% of the step" % (held, statistics.median(after), statistics.median(other),
                                                           snap_cost, 100 * snap_cost / statistics.median(other)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def snapshot_cost(snap2):
    """--snapshot-every 2: what a snapshot held its step, and the steps after one (its exchange in
    flight) against the others of the same run."""
    held = statistics.median(r["snapshot_s"] for r in snap2[2:] if "snapshot_s" in r)
    after = [r["step_time_s"] for r in snap2[2:] if r["step"] % 2 == 1]
    other = [r["step_time_s"] for r in snap2[2:] if r["step"] % 2 == 0]
    return held, after, other


def snapshot_cost_only(a):
    tmp = tempfile.mkdtemp(prefix="dtrain-ckpt-bench-")
    snap2 = run(a, ["--snapshot-every", "2"], os.path.join(tmp, "snapshot2.jsonl"))
    held, after, other = snapshot_cost(snap2)
    cost = held + statistics.median(after) - statistics.median(other)
    print("--snapshot-every 2, one run of %d steps: held %.3f s; steps with the exchange in flight %.3f s (%d), the "
          "others %.3f s (%d): a snapshot costs %.3f s = %.1f%% of the step" % (
              a.steps, held, statistics.median(after), len(after), statistics.median(other), len(other), cost,
              100 * cost / statistics.median(other)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "snapshot_every_2_held_s": held, "step_s_after": after, "step_s_other": other,
                       "snapshot_cost_s": cost, "snapshot_cost_fraction": cost / statistics.median(other)}, f, indent=1)


if __name__ == "__main__":
    main()
