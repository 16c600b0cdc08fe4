#!/usr/bin/env python3
"""Soak benchmark of in-process recovery (issue 30; Design note [in-process recovery],
include/dtrain/train/elastic.h): one dtrain-gpt --elastic run under dtrun --keep-survivors
--max-restarts F on one machine, a worker SIGKILLed at a random moment every time the job is back
at full size, F times; dtrun starts a replacement each time, which joins at a step boundary. The
run stops by itself (its --steps) and is bounded in time (--timeout).

Reported (and written as JSON): failures injected, the run's exit, hangs (a run past --timeout),
each step recorded once, the final parameters against the uninterrupted run (same command without
failures) next to the same run uninterrupted at one rank fewer (the noise floor of summing in
another order, which over thousands of steps outgrows 1e-5), the survivors' recovery time (failure seen -> regrouped) and the time from a kill to
the first step completed at the smaller size, and from a kill to the job back at full size.

  python3 bench/elastic_soak.py --failures 100 --out bench/results/elastic-soak.json
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(HERE, "..", "build", "bin")
MODEL = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--lr", "3e-3", "--threads", "1",
         "--global-batch-size", "12", "--batch-size", "2", "--collective-timeout", "60"]


def records(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


def workers(dtrun_pid):
    """pids of dtrun's dtrain-gpt children"""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().split(") ")[-1].split()
            with open(f"/proc/{p}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if int(fields[1]) == dtrun_pid and comm.startswith("dtrain-gpt"):
            pids.append(int(p))
    return pids


def run(args, steps, world, metrics, env_extra, elastic_flags, log):
    env = dict(os.environ, **env_extra)
    cmd = [os.path.join(BIN, "dtrun"), "--standalone", "-n", str(world)] + elastic_flags + \
          [os.path.join(BIN, "dtrain-gpt")] + MODEL + ["--steps", str(steps), "--elastic", "--metrics", metrics] + \
          ["--strategy", args.strategy] + (["--snapshot-every", "1"] if args.strategy not in ("ddp", "hsdp") else []) + \
          (["--shard-size", str(args.shard_size)] if args.strategy == "hsdp" else [])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--failures", type=int, default=100)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--slow-ms", type=int, default=60, help="DTRAIN_TEST_SLOW_STEP_MS: each step's extra time")
    ap.add_argument("--gap", type=int, default=5, help="steps at full size before the next kill")
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--strategy", default="ddp",
                    help="ddp, zero1, zero2 or fsdp (sharded: --snapshot-every 1), or hsdp (whole units of --shard-size)")
    ap.add_argument("--shard-size", type=int, default=2, help="hsdp: the shard group, a unit lost whole (Design note [whole units])")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tmp = tempfile.mkdtemp(prefix="dtrain-soak-")
    metrics = os.path.join(tmp, "soak.jsonl")
    log = open(os.path.join(tmp, "soak.log"), "w")
    t0 = time.time()
    proc = run(a, a.steps, a.world, metrics, {"DTRAIN_TEST_SLOW_STEP_MS": str(a.slow_ms)},
               ["--keep-survivors", "--max-restarts", str((a.failures + 5) * (a.shard_size if a.strategy == "hsdp" else 1))],
               log)  # (hsdp: a unit lost whole costs a replacement per rank)
    kills = []  # (time, pid)
    to_first_step, to_full = [], []
    while proc.poll() is None and time.time() - t0 < a.timeout and len(kills) < a.failures:
        recs = records(metrics)
        regroups = [r for r in recs if r.get("elastic")]
        steps = [r["step"] for r in recs if "loss" in r]
        full = not regroups or regroups[-1]["world_size"] == a.world
        since = (steps[-1] - regroups[-1]["from_step"] + 1) if regroups and steps else len(steps)
        if not full or since < a.gap:
            time.sleep(0.02)
            continue
        pids = workers(proc.pid)
        if len(pids) < a.world:
            time.sleep(0.02)
            continue
        time.sleep(rng.uniform(0, a.slow_ms / 1000.0))  # (a random moment of a step)
        victim = rng.choice(pids)
        kill_t, n_regroups = time.time(), len(regroups)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(kill_t)
        # the first step completed at the smaller size, then the job back at full size
        first, back, reported = None, None, False
        while proc.poll() is None and time.time() - t0 < a.timeout and back is None:
            if not reported and time.time() - kill_t > 5:  # (slow: dtrun prints what each rank is doing)
                os.kill(proc.pid, signal.SIGUSR1)
                reported = True
                print(f"failure {len(kills)}: not back at full size 5 s after the kill; asked dtrun for a report", flush=True)
                if os.environ.get("SOAK_GDB"):  # (every live worker's threads, for debugging)
                    for pid in workers(proc.pid):
                        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"],
                                             capture_output=True, text=True).stdout
                        with open(os.path.join(tmp, f"gdb-{pid}.txt"), "w") as f:
                            f.write(out)
            recs = records(metrics)
            later = [r for r in recs if r.get("elastic")][n_regroups:]
            if later and first is None:
                after = [r for r in recs[recs.index(later[0]) + 1:] if "loss" in r]
                if after:
                    first = time.time() - kill_t
            if len(later) >= 2 and later[-1]["world_size"] == a.world:
                back = time.time() - kill_t
            time.sleep(0.01)
        if first is not None:
            to_first_step.append(first)
        if back is not None:
            to_full.append(back)
    print(f"{len(kills)} failures injected in {time.time() - t0:.0f} s; waiting for the run's end", flush=True)
    try:
        code = proc.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        code, hung = proc.wait(), True
    wall = time.time() - t0
    recs = records(metrics)
    steps, redone = [], 0  # (each step's last record: a roll-back of sharded state records the steps it redoes again)
    for r in recs:
        if "loss" not in r:
            continue
        if r["step"] <= len(steps):
            redone += len(steps) - r["step"] + 1
            steps = steps[:r["step"] - 1]
        steps.append(r["step"])
    regroups = [r for r in recs if r.get("elastic")]
    final = [r for r in recs if r.get("final")]
    ref_metrics = os.path.join(tmp, "ref.jsonl")
    ref = run(a, a.steps, a.world, ref_metrics, {}, [], log)
    ref.wait()
    ref_final = [r for r in records(ref_metrics) if r.get("final")]
    # The noise floor: the same run uninterrupted at one rank fewer (the same global batch, sums in
    # another order) differs from the reference too; over thousands of steps that drift outgrows 1e-5.
    floor_metrics = os.path.join(tmp, "ref-smaller.jsonl")
    # (hsdp one unit fewer is a single shard group: refused under --elastic, so its equal, fsdp over those ranks)
    floor = argparse.Namespace(**dict(vars(a), strategy="fsdp")) if a.strategy == "hsdp" else a
    run(floor, a.steps, a.world - (a.shard_size if a.strategy == "hsdp" else 1), floor_metrics, {}, [], log).wait()
    floor_final = [r for r in records(floor_metrics) if r.get("final")]

    def rel_diff(x, y):
        return max(abs(x[k] - y[k]) / abs(y["param_sq"]) for k in ("param_sq", "param_checksum"))
    rel = rel_diff(final[0], ref_final[0]) if final and ref_final else None
    floor = rel_diff(floor_final[0], ref_final[0]) if floor_final and ref_final else None
    recovery = [r["recovery_s"] for r in regroups if r["world_size"] < a.world]
    out = {
        "command": " ".join(sys.argv),
        "world": a.world, "steps": a.steps, "slow_step_ms": a.slow_ms,
        "failures_injected": len(kills), "regroups": len(regroups),
        "shrinks": sum(1 for r in regroups if r["world_size"] < a.world),
        "grows": sum(1 for r in regroups if r["world_size"] == a.world),
        "exit_code": code, "hung": hung, "wall_s": round(wall, 1),
        "strategy": a.strategy, "steps_recorded": len(steps), "each_step_once": steps == list(range(1, a.steps + 1)),
        "redone_records": redone, "redone_as_said": redone <= sum(r.get("redone_steps", 0) for r in regroups),
        "param_rel_diff_vs_uninterrupted": rel,
        "param_rel_diff_uninterrupted_one_rank_fewer": floor,
        "recovery_s": {"median": statistics.median(recovery), "max": max(recovery)} if recovery else None,
        "kill_to_first_step_s": {"median": statistics.median(to_first_step), "max": max(to_first_step)}
        if to_first_step else None,
        "kill_to_full_size_s": {"median": statistics.median(to_full), "max": max(to_full)} if to_full else None,
        "log": os.path.join(tmp, "soak.log"),
    }
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    # (a run that moves between world sizes sums in orders neither reference has: measured 1.1-2.3x
    # the one-rank-fewer floor over 1000 steps, DDP and FSDP alike; the tests' short runs hold 1e-5)
    ok = rel is not None and floor is not None and rel <= max(1e-5, 3 * floor)
    return 0 if code == 0 and not hung and out["each_step_once"] and out["redone_as_said"] and ok else 1


if __name__ == "__main__":
    sys.exit(main())
