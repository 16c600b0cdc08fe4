#!/usr/bin/env python3
"""Recovery over a limited link (issue 30's time bound; Design note [in-process recovery],
include/dtrain/train/elastic.h): the time from a rank's death to the first step completed at the
new size should stay within 5 s plus the state moved across the link divided by the link's
measured bandwidth. Both figures are measured here.

Two "machines" on this one: network namespaces A (node 0) and B (node 1) joined by a veth pair
whose ends are limited to --rate by `tc qdisc ... tbf` (only the addresses made here: 10.78.N.1
and .2). First the link's bandwidth: dtrain-comm-bench's all-reduce of --probe-floats between one
rank on each side (with two ranks a ring all-reduce sends its whole payload each way). Then, for
each --strategies entry, a dtrun and two ranks on each side, dtrain-gpt --elastic (--snapshot-every
1 where the state is sharded) under --keep-survivors --max-restarts 1: once the run is steady, rank
3 (on node 1) is SIGKILLed at a random moment of a step; ranks 0-2 go on at 3 (the state re-split
over them, part of it across the link; under hsdp, whose shard group is a node, ranks 0-1 go on
as one replica), and node 1's dtrun starts replacements that join and
receives its state from the live ranks (across the link). For both changes: the state moved (the
first step's recovery_mib after it, all ranks', and its part across nodes), the time from the kill
to that step completed (the metrics file polled every 10 ms; for the join it includes the
replacement process's start), and the bound.

Needs root (network namespaces) and build/bin. Cleans up its namespaces.
  sudo python3 bench/elastic_link_bench.py --rate 100mbit --out bench/results/elastic-link.json
"""
import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNING = []  # (the dtruns started, killed if the bench stops early)
BIN = os.path.join(HERE, "..", "build", "bin")


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Link:
    """Two namespaces joined by a veth pair, each end limited to `rate`."""

    def __init__(self, rate):
        pid = os.getpid()
        self.net = pid % 200 + 20
        self.a, self.b, va, vb = f"elA{pid}", f"elB{pid}", f"ela{pid}", f"elb{pid}"
        sh("ip", "netns", "add", self.a)
        sh("ip", "netns", "add", self.b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, v, host in ((self.a, va, 1), (self.b, vb, 2)):
            sh("ip", "link", "set", v, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"10.78.{self.net}.{host}/24", "dev", v)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", v, "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", v, "root", "tbf", "rate", rate, "burst", "64kb",
               "latency", "200ms")
        self.master = f"10.78.{self.net}.1"

    def close(self):
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def dtrun(link, node, nproc, port, program, extra_flags=(), env=None, log=None):
    """dtrun on `node`'s side; with `log` (a path) its lines go there stamped with the wall time."""
    ns = link.a if node == 0 else link.b
    cmd = ["ip", "netns", "exec", ns, os.path.join(BIN, "dtrun"), "--nnodes", "2", "--nproc-per-node", str(nproc),
           "--node-rank", str(node), "--master-addr", link.master, "--master-port", str(port), "--rdzv-timeout", "60",
           *extra_flags, *program]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    if log:
        def stamp():
            with open(log, "w") as f:
                for line in p.stdout:
                    f.write(f"{time.time():.3f} {line}")
                    f.flush()
        p.stamper = threading.Thread(target=stamp, daemon=True)
        p.stamper.start()
    return p


def bandwidth(link, floats):
    """MiB/s each way: a two-rank ring all-reduce sends its whole payload each way."""
    probe = [os.path.join(BIN, "dtrain-comm-bench"), str(floats)]
    p1 = dtrun(link, 1, 1, 29400, probe)
    p0 = dtrun(link, 0, 1, 29400, probe)
    out0, _ = p0.communicate(timeout=600)
    p1.communicate(timeout=60)
    m = re.search(rf"^(?:\[0\]:)?\s*{floats}\s+([0-9.]+)", out0, re.M)
    if not m:
        sys.exit(f"elastic_link_bench: no all-reduce timing in:\n{out0}")
    return floats * 4 / 1048576 / (float(m.group(1)) / 1000)


def records(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def rank_pid(dtrun_pid, rank):
    """The pid of dtrun's worker whose RANK is `rank` (ip netns exec runs dtrun in its place)."""
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                parent = int(f.read().split(") ")[-1].split()[1])
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if parent == dtrun_pid and f"RANK={rank}".encode() in env:
            return int(p)
    return None


def wait_for(metrics, pred, since, timeout):
    """Polls the metrics file every 10 ms for the first record after index `since` that pred
    accepts; (its index, the time it was seen) or (None, None)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        rs = records(metrics)
        for i in range(since, len(rs)):
            if pred(rs[i]):
                return i, time.time()
        time.sleep(0.01)
    return None, None


def victim_of(logs, strategy, kill_time):
    """The pid the kills log names for the kill at `kill_time` (results saved before "victim" was kept)."""
    with open(os.path.join(logs, f"{strategy}-kills.log")) as f:
        for line in f:
            t, _, _, pid = line.split()[:4]
            if abs(float(t) - kill_time) < 0.01:
                return int(pid)
    return None


def death_time(log, pid, timeout=60):
    """When node 1's dtrun saw worker `pid` end (its stamped log line): the rank's death. A SIGKILLed
    process can take seconds to be gone (here up to 9 s under the shaped link); the bound counts
    from its death."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        with open(log) as f:
            for line in f:
                if f"pid {pid}) was killed" in line:
                    return float(line.split()[0])
        time.sleep(0.05)
    return None


def one_kill(metrics, dtrun_pid, since, a, rng, strategy, tmp):
    """Once step record `since` exists (and `a.gap` more): rank 3 on node 1 SIGKILLed at a random
    moment; the loss (the first step after it) and the join (the first step back at 4 ranks)."""
    seen, _ = wait_for(metrics, lambda r: r.get("step") is not None, since + a.gap, 600)
    if seen is None:
        sys.exit(f"elastic_link_bench: {strategy} did not go on to kill again (logs in {tmp})")
    victim = rank_pid(dtrun_pid, 3)
    if victim is None:
        sys.exit(f"elastic_link_bench: rank 3's process not found under node 1's dtrun ({dtrun_pid})")
    step_s = records(metrics)[seen]["step_time_s"]
    time.sleep(rng.uniform(0, a.moment if a.moment >= 0 else step_s))  # (a random moment of a step)
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    with open(os.path.join(tmp, f"{strategy}-kills.log"), "a") as f:
        f.write(f"{t_kill:.3f} SIGKILL pid {victim} (after record {seen})\n")
    out = {"loss": None, "join": None, "kill_time": t_kill, "step_time_s": records(metrics)[seen]["step_time_s"],
           "victim": victim}
    since = seen + 1
    # (the loss: 3 ranks, or 2 where a unit of 2 leaves whole, hsdp's shard group a node; the join: 4 again)
    for label, full in (("loss", False), ("join", True)):
        regroup, _ = wait_for(metrics, lambda r: r.get("elastic") and (r.get("world_size") == 4) == full, since, 300)
        if regroup is None:
            print(f"elastic_link_bench: {strategy}: no {label} within 300 s (logs in {tmp})", flush=True)
            break
        first, t_first = wait_for(metrics, lambda r: "recovery_mib" in r, regroup + 1, 300)
        if first is None:
            sys.exit(f"elastic_link_bench: {strategy}: no step after the regroup (logs in {tmp})")
        r, g = records(metrics)[first], records(metrics)[regroup]
        out[label] = {"world_size": g["world_size"], "recovery_s": g["recovery_s"], "redone_steps": g["redone_steps"],
                      "moved_mib": r["recovery_mib"], "moved_mib_across_nodes": r["recovery_mib_across_nodes"],
                      "kill_to_first_step_s": t_first - t_kill, "first_step": r["step"]}
        since = first + 1
    t_death = death_time(os.path.join(tmp, f"{strategy}-n1.log"), victim)
    out["kill_to_death_s"] = t_death - t_kill if t_death else None
    for label in ("loss", "join"):
        if out[label] and t_death:
            out[label]["death_to_first_step_s"] = out[label]["kill_to_first_step_s"] - out["kill_to_death_s"]
    return out, since


def one_strategy(a, link, strategy, port, rng, tmp):
    metrics = os.path.join(tmp, f"{strategy}.jsonl")
    sharded = strategy in ("zero1", "zero2", "fsdp")
    program = [os.path.join(BIN, "dtrain-gpt"), *a.model.split(), "--threads", "1", "--steps", str(a.steps),
               "--elastic", "--strategy", strategy, "--collective-timeout", "60", "--global-batch-size", "8",
               "--batch-size", "2"] + (["--snapshot-every", "1"] if sharded else []) + a.extra.split()
    # (hsdp: a unit of 2 lost, 2 replacements a kill)
    flags = ["--keep-survivors", "--max-restarts", str(2 * a.kills), "--heartbeat-timeout", "5"]
    logs = [os.path.join(tmp, f"{strategy}-n{k}.log") for k in (0, 1)]
    p1 = dtrun(link, 1, 2, port, program, flags, log=logs[1])
    p0 = dtrun(link, 0, 2, port, program + ["--metrics", metrics], flags, log=logs[0])
    RUNNING.extend([p0, p1])
    kills, since = [], 0
    for _ in range(a.kills):
        k, since = one_kill(metrics, p1.pid, since, a, rng, strategy, tmp)
        kills.append(k)
        if not k["join"]:
            break
    for p in (p0, p1):
        p.wait(timeout=900)
        p.stamper.join(timeout=10)
    return {"strategy": strategy, "kills": kills, "exit_codes": [p0.returncode, p1.returncode]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--model", default="--layers 2 --d-model 192 --heads 4 --seq-len 64",
                    help="dtrain-gpt's model flags (the default: about 1M parameters, 12 MiB of state with Adam)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", type=int, default=3, help="kills in each run, each once the job is back at 4 ranks")
    ap.add_argument("--gap", type=int, default=3, help="steps recorded before each kill (after the last change)")
    ap.add_argument("--extra", default="", help="more dtrain-gpt flags (say --snapshot-sync)")
    ap.add_argument("--moment", type=float, default=-1,
                    help="the kill comes 0 to this many seconds after a step's record (default: that step's time)")
    ap.add_argument("--probe-floats", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--report", default="", help="print the table of a saved --out file (with its logs) and stop")
    a = ap.parse_args()
    if a.report:
        saved = json.load(open(a.report))
        for row in saved["rows"]:
            for k in row["kills"]:
                pid = k.get("victim") or victim_of(saved["logs"], row["strategy"], k["kill_time"])
                t = death_time(os.path.join(saved["logs"], f"{row['strategy']}-n1.log"), pid, timeout=0.1) if pid else None
                k["kill_to_death_s"] = t - k["kill_time"] if t else None
                for label in ("loss", "join"):
                    if k[label] and t:
                        k[label]["death_to_first_step_s"] = k[label]["kill_to_first_step_s"] - k["kill_to_death_s"]
        report(saved["rows"], saved["bandwidth_mib_s"])
        with open(a.report, "w") as f:
            json.dump(saved, f, indent=1)
        return
    if os.geteuid() != 0:
        sys.exit("elastic_link_bench: creating network namespaces needs root")
    rng = random.Random(a.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("elastic_link_bench: stopped (SIGTERM)"))  # (the namespaces go)
    tmp = tempfile.mkdtemp(prefix="dtrain-elastic-link-")
    link = None
    try:
        link = Link(a.rate)
        mib_s = bandwidth(link, a.probe_floats)
        print(f"link {a.rate} each way between two network namespaces: measured {mib_s:.2f} MiB/s "
              f"(an all-reduce of {a.probe_floats * 4 / 1048576:.0f} MiB, one rank each side)", flush=True)
        rows = [one_strategy(a, link, s, 29500 + i, rng, tmp) for i, s in enumerate(a.strategies.split(","))]
    finally:
        for p in RUNNING:  # (a run given up on: its processes keep the namespaces otherwise)
            if p.poll() is None:
                p.kill()
        if link:
            link.close()
    report(rows, mib_s)
    result = {"rate": a.rate, "bandwidth_mib_s": mib_s, "model": a.model, "extra": a.extra, "steps": a.steps, "kills": a.kills,
              "rows": rows, "logs": tmp}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    bad = [r["strategy"] for r in rows if r["exit_codes"] != [0, 0] or not all(k["join"] for k in r["kills"])]
    if bad:
        sys.exit(f"elastic_link_bench: a dtrun did not end 0 under {bad} (logs in {tmp})")



def report(rows, mib_s):
    print("| plan | change | moved (all ranks) | across the link | bound: 5 s + across / bandwidth | death -> first step "
          "| of which recovery | one step before | within the bound | SIGKILL -> death |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for row in rows:
        for label in ("loss", "join"):
            ks = [k for k in row["kills"] if k[label] and k[label].get("death_to_first_step_s") is not None]
            if not ks:
                continue
            cs = [k[label] for k in ks]
            for c in cs:
                c["bound_s"] = 5 + c["moved_mib_across_nodes"] / mib_s
            took = [c["death_to_first_step_s"] for c in cs]
            within = sum(c["death_to_first_step_s"] <= c["bound_s"] for c in cs)
            dying = [k["kill_to_death_s"] for k in ks]
            print(f"| {row['strategy']} | {label} ({cs[0]['world_size']} ranks{', a replacement started' if label == 'join' else ''}) "
                  f"| {med(c['moved_mib'] for c in cs):.1f} MiB | {med(c['moved_mib_across_nodes'] for c in cs):.1f} MiB "
                  f"| {med(c['bound_s'] for c in cs):.2f} s | {med(took):.2f} s (max {max(took):.2f}) "
                  f"| {med(c['recovery_s'] for c in cs):.2f} s | {med(k['step_time_s'] for k in ks):.2f} s | {within} of {len(cs)} "
                  f"| {med(dying):.2f} s (max {max(dying):.2f}) |")


if __name__ == "__main__":
    main()
