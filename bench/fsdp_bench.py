#!/usr/bin/python3
"""FSDP benchmark (issue 4, "Checks"), three parts in one run:

throughput  dtrain DDP against dtrain FSDP (full shard, one unit per block) at --world ranks on the
            demo model, alternating --repeats times; tokens/s ratio FSDP/DDP (target >= 0.85) for
            each backward schedule of --modes (full shard), with grad_op, none and hybrid sharding
            for information, the forward/backward/optimizer medians of every contender, and
            PyTorch's FSDP (bench/gpt_fsdp.py): whether it runs.
memory      full shard at W = --mem-worlds on a larger model, each backward schedule of --mem-modes
            side by side: per-rank peak of the bytes FSDP owns (peak_owned_mib_per_rank) plus the
            AdamW state, against the bound 16 B x parameters / W + 8 B x the largest unit's
            parameters (target <= 1.1x), and peak RSS; plus --mem-trend-layers runs at the largest W.
big         a GPT whose fp32 AdamW training does not fit one process under a per-process
            address-space limit (prlimit --as, inherited by every dtrun worker; RLIMIT_AS is per
            process) while FSDP full shard at W=4 with --init-on-ranks trains under the same limit.
            The limit is calibrated: both run once without it while every process's VmPeak is
            sampled from /proc; the limit is the midpoint (or --big-limit-mib).

    /usr/bin/python3 bench/fsdp_bench.py --build-dir build-bench                 # all parts
    /usr/bin/python3 bench/fsdp_bench.py --parts throughput --repeats 5
    /usr/bin/python3 bench/fsdp_bench.py --parts memory --mem-modes default,lean,none,before-serial,gathered1

Backward schedules (Design note [backward memory] in src/fsdp/fully_sharded_data_parallel.cpp), by
name: the dtrain-gpt flags of each are in MODES.
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib

WORKER = "dtrain-gpt"

# Backward schedules: (dtrain-gpt flags, block-sized buffers a rank holds in a block's backward:
# full parameters and flat gradient buffers; see Design note [backward memory]).
MODES = {
    "default": ([], 4),  # BeforeBackward prefetch, reductions overlapping the next unit's backward
    "lean": (["--backward-prefetch", "after", "--overlap-reduction", "off"], 2),
    "after": (["--backward-prefetch", "after"], 3),
    "none": (["--backward-prefetch", "none"], 3),
    "before-serial": (["--overlap-reduction", "off"], 3),
    "none-serial": (["--backward-prefetch", "none", "--overlap-reduction", "off"], 2),
    "gathered1": (["--max-gathered-units", "1"], 3),  # no prefetch once one block is gathered
    "gathered1-serial": (["--max-gathered-units", "1", "--overlap-reduction", "off"], 2),
}


def mode_list(text):
    modes = [m for m in text.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit("unknown backward schedule '%s' (%s)" % (m, ", ".join(MODES)))
    return modes


def parse_args():
    ap = benchlib.common_args(__doc__)
    ap.set_defaults(steps=30, repeats=5)
    ap.add_argument("--build-dir", default="build", help="where bin/dtrun and bin/dtrain-gpt are (relative to the repo)")
    ap.add_argument("--parts", default="throughput,memory,big")
    ap.add_argument("--modes", default="default,lean", help="full-shard backward schedules timed (MODES)")
    ap.add_argument("--mem-modes", default="default,lean", help="backward schedules measured (MODES)")
    ap.add_argument("--mem-worlds", default="1,2,4")
    ap.add_argument("--mem-layers", type=int, default=8)
    ap.add_argument("--mem-d-model", type=int, default=256)
    ap.add_argument("--mem-seq-len", type=int, default=64)
    ap.add_argument("--mem-batch-size", type=int, default=2)
    ap.add_argument("--mem-steps", type=int, default=3)
    ap.add_argument("--mem-trend-layers", default="16,32", help="more layers at the largest W ('' for none)")
    ap.add_argument("--big-layers", type=int, default=12)
    ap.add_argument("--big-d-model", type=int, default=1024)
    ap.add_argument("--big-heads", type=int, default=8)
    ap.add_argument("--big-world", type=int, default=4)
    ap.add_argument("--big-steps", type=int, default=2)
    ap.add_argument("--big-limit-mib", type=int, default=0, help="the per-process limit; 0: calibrate")
    return ap.parse_args()


# ----------------------------------------------------------------------------------------------
# Commands


def gpt_cmd(a, world, strategy, metrics, flags, extra=()):
    b = a.build_dir.rstrip("/")
    return ([b + "/bin/dtrun", "--standalone", "--nproc-per-node", str(world), b + "/bin/" + WORKER, "--strategy",
             strategy] + list(flags) + (["--metrics", metrics] if metrics else []) + list(extra))


def shape_flags(layers, d_model, heads, seq_len, batch_size, steps, threads=1):
    return ["--layers", str(layers), "--d-model", str(d_model), "--heads", str(heads), "--seq-len", str(seq_len),
            "--batch-size", str(batch_size), "--steps", str(steps), "--threads", str(threads)]


def shown(cmd, metrics_name="M.jsonl"):
    """A command line for the README: metrics files under a placeholder name."""
    return " ".join(metrics_name if c.endswith(".jsonl") else c for c in cmd)


# ----------------------------------------------------------------------------------------------
# Processes: run a command and sample every descendant's /proc status (VmPeak, VmHWM, RLIMIT_AS)


def _children():
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                s = f.read()
        except OSError:
            continue
        kids.setdefault(int(s[s.rfind(")") + 2:].split()[1]), []).append(int(d))
    return kids


def _proc_info(pid):
    info = {}
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == "Name":
                    info["name"] = value.strip()
                elif key in ("VmPeak", "VmHWM"):
                    info[key] = int(value.split()[0]) / 1024.0
        with open("/proc/%d/limits" % pid) as f:
            for line in f:
                if line.startswith("Max address space"):
                    soft = line.split()[3]
                    info["as_limit_mib"] = None if soft == "unlimited" else int(soft) / 1048576.0
    except (OSError, ValueError, IndexError):
        return None
    return info if "VmPeak" in info else None


def run_watched(cmd, env, timeout=600):
    """Runs cmd (in the repository root), sampling its process tree every 50 ms. Returns
    (exit status, output, {pid: {name, VmPeak, VmHWM (MiB), as_limit_mib}}, seconds)."""
    with tempfile.TemporaryFile(mode="w+") as out:
        t0 = time.time()
        p = subprocess.Popen(cmd, cwd=benchlib.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        procs = {}
        while p.poll() is None:
            if time.time() - t0 > timeout:
                p.terminate()  # dtrun forwards it to its workers
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                break
            kids, todo = _children(), [p.pid]
            while todo:
                pid = todo.pop()
                todo.extend(kids.get(pid, []))
                info = _proc_info(pid)
                if info:  # VmPeak only grows: the last sample is the best
                    procs[pid] = info
            time.sleep(0.05)
        rc = p.wait()
        out.seek(0)
        return rc, out.read(), procs, time.time() - t0


def workers(procs):
    return [i for i in procs.values() if i["name"] == WORKER]


def error_lines(output):
    """The workers' 'error:' lines, without the '[rank]:' prefixes and duplicates."""
    seen = []
    for line in output.splitlines():
        text = line.split("]:", 1)[1] if line.startswith("[") and "]:" in line else line
        if ("error" in text.lower() or "what()" in text or "Killed" in text) and text.strip() not in seen:
            seen.append(text.strip())
    return seen


def env_for(a):
    return dict(os.environ, OMP_NUM_THREADS=str(a.threads))


# ----------------------------------------------------------------------------------------------
# Part 1: throughput


def per_step_medians(path, warmup):
    steps, _ = benchlib.read_metrics(path)
    timed = steps[warmup:]
    return {k: 1000 * statistics.median(s[k] for s in timed) for k in ("forward_s", "backward_s", "optimizer_s")}


def pytorch_fsdp(a):
    """Tries bench/gpt_fsdp.py (torch.distributed.fsdp) on the same model; returns (ran, summary)."""
    metrics = os.path.join(tempfile.mkdtemp(prefix="dtrain-fsdp-bench-"), "pytorch-fsdp.jsonl")
    cmd = ["/usr/bin/python3", "-m", "torch.distributed.run", "--redirects", "1", "--tee", "1", "--standalone",
           "--nproc_per_node", str(a.world), "bench/gpt_fsdp.py"] + benchlib.model_flags(a) + ["--metrics", metrics]
    try:
        res = subprocess.run(cmd, cwd=benchlib.ROOT, env=env_for(a), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, ["timed out after 600 s"], cmd
    if res.returncode == 0 and os.path.exists(metrics):
        steps, _ = benchlib.read_metrics(metrics)
        return True, [statistics.median(s["step_time_s"] for s in steps[a.warmup:])], cmd
    lines = []
    for line in res.stdout.splitlines():
        if "gpt_fsdp:" in line:
            text = line[line.index("gpt_fsdp:") + len("gpt_fsdp:"):].strip()
            if text not in lines:
                lines.append(text)
    return False, lines or ["exit status %d: %s" % (res.returncode, res.stdout.strip().splitlines()[-1:])], cmd


def throughput(a, report):
    fsdp = lambda sharding, mode="default": (lambda m: gpt_cmd(  # noqa: E731
        a, a.world, "fsdp", m, benchlib.model_flags(a), ["--sharding", sharding, "--wrap", "block"] + MODES[mode][0]))
    modes = mode_list(a.modes)
    contenders = [("ddp", "dtrain DDP", lambda m: gpt_cmd(a, a.world, "ddp", m, benchlib.model_flags(a)))]
    contenders += [("fsdp-full" + ("" if mode == "default" else "-" + mode),
                    "dtrain FSDP full shard" + ("" if mode == "default" else ", " + mode), fsdp("full", mode))
                   for mode in modes]
    contenders += [
        ("fsdp-grad_op", "dtrain FSDP grad_op", fsdp("grad_op")),
        ("fsdp-none", "dtrain FSDP none", fsdp("none")),
        ("fsdp-hybrid", "dtrain FSDP hybrid", fsdp("hybrid")),
    ]
    files = {name: [] for name, _, _ in contenders}

    def recording(name, make):  # keeps each run's metrics path for the per-phase medians
        return lambda m: (files[name].append(m), make(m))[1]

    print("throughput: %d contenders x %d repeats, alternating" % (len(contenders), a.repeats), flush=True)
    summary, runs = benchlib.run_all(a, [(name, recording(name, make)) for name, _, make in contenders])
    tokens_per_step = a.batch_size * a.world * a.seq_len
    ddp_ms = summary["ddp"]["step_time_ms"]
    rows = []
    for name, label, make in contenders:
        phases = [per_step_medians(f, a.warmup) for f in files[name]]
        s = summary[name]
        paired = [d["step_time_s"] / r["step_time_s"] for d, r in zip(runs["ddp"], runs[name])]
        rows.append(dict(name=name, label=label, step_time_ms=s["step_time_ms"],
                         tokens_per_s=1000 * tokens_per_step / s["step_time_ms"], vs_ddp=ddp_ms / s["step_time_ms"],
                         paired_vs_ddp=paired, peak_rss_mib=s["peak_rss_mib"],
                         optimizer_state_mib=s["optimizer_state_mib"], first_losses=s["first_losses"],
                         **{k: statistics.median(p[k] for p in phases) for k in ("forward_s", "backward_s", "optimizer_s")},
                         command=shown(make("M.jsonl"))))
    ran, py, py_cmd = pytorch_fsdp(a)
    benchlib.header(a, "FSDP throughput")
    print("same work: first 3 losses of FSDP full shard and DDP agree to %.1e (relative)" %
          benchlib.same_work(summary, "fsdp-full", "ddp"))
    print("%-36s %9s %9s %7s %7s %7s %7s %9s %9s" % ("", "step ms", "tokens/s", "vs DDP", "fwd ms", "bwd ms", "opt ms",
                                                      "RSS MiB", "opt MiB"))
    for r in rows:
        print("%-36s %9.1f %9.0f %7.2f %7.1f %7.1f %7.1f %9.0f %9.2f" % (
            r["label"], r["step_time_ms"], r["tokens_per_s"], r["vs_ddp"], r["forward_s"], r["backward_s"],
            r["optimizer_s"], r["peak_rss_mib"], r["optimizer_state_mib"]))
    for full in rows[1:1 + len(modes)]:
        print("tokens/s %s / DDP: %.2f (medians of runs); per alternating pair: %s -> median %.2f; "
              "target >= 0.85" % (full["label"][len("dtrain "):], full["vs_ddp"],
                                  " ".join("%.2f" % x for x in full["paired_vs_ddp"]),
                                  statistics.median(full["paired_vs_ddp"])))
    if ran:
        print("PyTorch FSDP: median step %.1f ms" % (1000 * py[0]))
    else:
        print("PyTorch FSDP (torch.distributed.fsdp, torch 1.13, CPU/Gloo) does not run:")
        for line in py:
            print("  " + line)
    report["throughput"] = dict(rows=rows, pytorch_fsdp=dict(ran=ran, result=py, command=" ".join(py_cmd)))


# ----------------------------------------------------------------------------------------------
# Part 2: memory


def gpt_units(layers, d, seq_len, vocab=256):
    """(parameters of one GPT block, of the root unit: embeddings, ln_f, lm_head; total)."""
    block = 12 * d * d + 13 * d
    root = vocab * d + seq_len * d + 2 * d + vocab * d
    return block, root, layers * block + root


def memory_run(a, world, layers, mode, tmp):
    metrics = os.path.join(tmp, "mem-w%d-l%d-%s.jsonl" % (world, layers, mode))
    flags = shape_flags(layers, a.mem_d_model, a.heads, a.mem_seq_len, a.mem_batch_size, a.mem_steps)
    cmd = gpt_cmd(a, world, "fsdp", metrics, flags, ["--sharding", "full", "--wrap", "block"] + MODES[mode][0])
    rc, out, _, secs = run_watched(cmd, env_for(a))
    if rc != 0:
        sys.exit("memory run failed (%d): %s\n%s" % (rc, " ".join(cmd), out[-3000:]))
    _, final = benchlib.read_metrics(metrics)
    block, root, params = gpt_units(layers, a.mem_d_model, a.mem_seq_len)
    if params != final["parameters"]:
        sys.exit("parameter count: formula %d, dtrain-gpt %d" % (params, final["parameters"]))
    mib = 1.0 / 1048576
    per_rank = [o + s for o, s in zip(final["peak_owned_mib_per_rank"], final["optimizer_state_mib_per_rank"])]
    bound = (16.0 * params / world + 8.0 * max(block, root)) * mib
    # What the schedule holds in a block's backward: the shards, their gradients and Adam state,
    # the root (gathered with its gradient buffer through the whole backward) and MODES[mode][1]
    # block-sized fp32 buffers (Design note [backward memory]).
    expected = (16.0 * params / world + 8.0 * root + 4.0 * MODES[mode][1] * block) * mib
    measured = max(per_rank)
    row = dict(world=world, layers=layers, mode=mode, flags=" ".join(MODES[mode][0]), parameters=params,
               largest_unit=max(block, root), peak_owned_mib=max(final["peak_owned_mib_per_rank"]),
               optimizer_state_mib=max(final["optimizer_state_mib_per_rank"]), measured_mib=measured, bound_mib=bound,
               ratio=measured / bound, schedule_estimate_mib=expected, ratio_vs_estimate=measured / expected,
               peak_rss_mib=max(final["peak_rss_mib_per_rank"]), seconds=secs, command=shown(cmd))
    print("  W=%d layers %2d %-16s owned %.1f + Adam %.1f = %.1f MiB, bound %.1f MiB -> %.2fx; peak RSS %.0f MiB "
          "(%.0f s)" % (world, layers, mode, row["peak_owned_mib"], row["optimizer_state_mib"], measured, bound,
                        row["ratio"], row["peak_rss_mib"], secs), flush=True)
    return row


def memory(a, report):
    tmp = tempfile.mkdtemp(prefix="dtrain-fsdp-mem-")
    worlds = [int(w) for w in a.mem_worlds.split(",") if w]
    modes = mode_list(a.mem_modes)
    print("memory: full shard, %d layers, d_model %d, batch %d x %d, %d steps, schedules %s" % (
        a.mem_layers, a.mem_d_model, a.mem_batch_size, a.mem_seq_len, a.mem_steps, ", ".join(modes)), flush=True)
    shapes = [(w, a.mem_layers) for w in worlds] + [(max(worlds), int(l)) for l in a.mem_trend_layers.split(",") if l]
    rows = [memory_run(a, w, l, mode, tmp) for w, l in shapes for mode in modes]
    print()
    print("FSDP memory: full shard, --wrap block, d_model %d, batch %d x %d per rank, AdamW, %d steps" % (
        a.mem_d_model, a.mem_batch_size, a.mem_seq_len, a.mem_steps))
    print("bound = 16 B x parameters / W + 8 B x largest unit; schedule estimate = 16 B x parameters / W + "
          "8 B x root + 4 B x block x (block-sized buffers the schedule holds)")
    for m in modes:
        print("  %-16s %s" % (m, " ".join(MODES[m][0]) or "(dtrain-gpt's defaults)"))
    print("%3s %6s %10s %-16s %10s %9s %9s %9s %8s %10s %8s %8s" % (
        "W", "layers", "params", "schedule", "owned MiB", "Adam MiB", "sum MiB", "bound", "ratio", "estimate", "vs est",
        "RSS MiB"))
    for r in rows:
        print("%3d %6d %10d %-16s %10.1f %9.1f %9.1f %9.1f %8.2f %10.1f %8.2f %8.0f" % (
            r["world"], r["layers"], r["parameters"], r["mode"], r["peak_owned_mib"], r["optimizer_state_mib"],
            r["measured_mib"], r["bound_mib"], r["ratio"], r["schedule_estimate_mib"], r["ratio_vs_estimate"],
            r["peak_rss_mib"]))
    print()
    print("side by side, sum / bound (peak RSS MiB):")
    print("%3s %6s " % ("W", "layers") + " ".join("%18s" % m for m in modes))
    for w, l in shapes:
        cells = [next(r for r in rows if (r["world"], r["layers"], r["mode"]) == (w, l, m)) for m in modes]
        print("%3d %6d " % (w, l) + " ".join("%18s" % ("%.2f (%.0f)" % (c["ratio"], c["peak_rss_mib"])) for c in cells))
    print("target: ratio <= 1.1")
    report["memory"] = rows


# ----------------------------------------------------------------------------------------------
# Part 3: a model that does not fit one process under a per-process limit trains at W=4


def big_cmd(a, world, strategy, metrics, layers=None, d_model=None, heads=None):
    flags = shape_flags(layers or a.big_layers, d_model or a.big_d_model, heads or a.big_heads, 64, 1, a.big_steps)
    extra = ["--sharding", "full", "--wrap", "block", "--init-on-ranks"] if strategy == "fsdp" else []
    return gpt_cmd(a, world, strategy, metrics, flags, extra)


def limited(cmd, limit_mib):
    return cmd if not limit_mib else ["prlimit", "--as=%d" % (limit_mib * 1048576)] + cmd


def big_run(a, label, cmd, limit_mib, tmp):
    metrics = next((c for c in cmd if c.endswith(".jsonl")), None)
    rc, out, procs, secs = run_watched(limited(cmd, limit_mib), env_for(a))
    w = workers(procs)
    final = benchlib.read_metrics(metrics)[1] if rc == 0 and metrics and os.path.exists(metrics) else None
    row = dict(label=label, limit_mib=limit_mib, rc=rc, seconds=secs, command=shown(limited(cmd, limit_mib)),
               workers=len(w), vm_peak_mib=max((i["VmPeak"] for i in w), default=0.0),
               vm_hwm_mib=max((i["VmHWM"] for i in w), default=0.0),
               worker_as_limits_mib=sorted({i.get("as_limit_mib") for i in w}, key=lambda x: x or 0),
               launcher_vm_peak_mib=max((i["VmPeak"] for i in procs.values() if i["name"] == "dtrun"), default=0.0),
               errors=error_lines(out)[:3] if rc != 0 else [],
               steps_done=max([int(x) for x in re.findall(r"\bstep (\d+)/\d+", out)], default=0))
    if final:
        row.update(peak_rss_mib=max(final["peak_rss_mib_per_rank"]), parameters=final["parameters"],
                   peak_owned_mib=max(final["peak_owned_mib_per_rank"]),
                   optimizer_state_mib=max(final["optimizer_state_mib_per_rank"]),
                   step_time_s=final["mean_step_time_s"])
    print("  %-34s limit %6s: exit %d, %d worker(s), VmPeak %5.0f MiB, VmHWM %5.0f MiB (%.0f s)%s" % (
        label, "%d MiB" % limit_mib if limit_mib else "none", rc, len(w), row["vm_peak_mib"], row["vm_hwm_mib"], secs,
        (": " + row["errors"][0][:160]) if row["errors"] else ""), flush=True)
    return row


def big(a, report):
    tmp = tempfile.mkdtemp(prefix="dtrain-fsdp-big-")
    m = lambda name: os.path.join(tmp, name + ".jsonl")  # noqa: E731
    _, _, params = gpt_units(a.big_layers, a.big_d_model, 64)
    print("big model: %d layers, d_model %d (%.1fM parameters; fp32 AdamW needs 16 B each = %.0f MiB), "
          "batch 1 x 64, %d steps" % (a.big_layers, a.big_d_model, params / 1e6, 16 * params / 1048576.0, a.big_steps),
          flush=True)
    single = lambda name: big_cmd(a, 1, "single", m(name))  # noqa: E731
    sharded = lambda name: big_cmd(a, a.big_world, "fsdp", m(name))  # noqa: E731
    rows = []
    limit = a.big_limit_mib
    if not limit:
        rows.append(big_run(a, "calibrate: single, no limit", single("cal-single"), 0, tmp))
        rows.append(big_run(a, "calibrate: FSDP W=%d, no limit" % a.big_world, sharded("cal-fsdp"), 0, tmp))
        s, f = rows[0]["vm_peak_mib"], rows[1]["vm_peak_mib"]
        if rows[0]["rc"] or rows[1]["rc"] or not s > f:
            sys.exit("big model calibration failed: %s" % json.dumps(rows, indent=1))
        limit = int((s + f) / 2) // 16 * 16
    tiny = big_cmd(a, a.big_world, "fsdp", m("tiny"), layers=1, d_model=64, heads=4)
    rows.append(big_run(a, "tiny model, FSDP W=%d, limited" % a.big_world, tiny, limit, tmp))
    rows.append(big_run(a, "single process, limited", single("single"), limit, tmp))
    rows.append(big_run(a, "FSDP full shard W=%d, limited" % a.big_world, sharded("fsdp"), limit, tmp))
    one, fs = rows[-2], rows[-1]
    print()
    print("FSDP big model: %d layers, d_model %d, %d parameters; per-process address-space limit %d MiB "
          "(prlimit --as, RLIMIT_AS of every worker: %s MiB)" % (
              a.big_layers, a.big_d_model, params, limit, ", ".join("%.0f" % x if x else "unlimited"
                                                                     for x in fs["worker_as_limits_mib"])))
    for r in rows:
        extra = ""
        if "peak_rss_mib" in r:
            extra = "; peak RSS %.0f MiB, %sAdam %.0f MiB per rank, %.1f s/step" % (
                r["peak_rss_mib"], "FSDP-owned %.0f + " % r["peak_owned_mib"] if r["peak_owned_mib"] > 0 else "",
                r["optimizer_state_mib"], r["step_time_s"])
        print("  %-34s %-6s VmPeak %5.0f MiB%s" % (r["label"], "passes" if r["rc"] == 0 else "FAILS", r["vm_peak_mib"],
                                                   extra))
        for e in r["errors"][:1]:
            print("      after %d of %d steps: %s" % (r["steps_done"], a.big_steps, e[:300]))
    ok = one["rc"] != 0 and fs["rc"] == 0
    print("single process fails and FSDP W=%d trains under the same per-process limit: %s" % (a.big_world, "yes" if ok else "NO"))
    report["big"] = dict(limit_mib=limit, parameters=params, rows=rows, shown=ok)


def main():
    a = parse_args()
    parts = [p for p in a.parts.split(",") if p]
    for p in parts:
        if p not in ("throughput", "memory", "big"):
            sys.exit("--parts: unknown part '%s' (throughput, memory, big)" % p)
    if "big" in parts and not shutil.which("prlimit"):
        sys.exit("the big-model part needs prlimit (util-linux)")
    for tool in ("dtrun", WORKER):
        if not os.path.exists(os.path.join(benchlib.ROOT, a.build_dir, "bin", tool)):
            sys.exit("no %s/bin/%s: build it first (cmake --build %s --target dtrain-gpt dtrun)" % (a.build_dir, tool, a.build_dir))
    print("BLAS %s, %d intra-op thread(s) per rank, %d CPU(s), load average %.1f" % (
        benchlib.blas_name(), a.threads, os.cpu_count(), os.getloadavg()[0]), flush=True)
    t0 = time.time()
    report = {}
    for p in parts:
        globals()[p](a, report)
        print(flush=True)
    print("total %.0f s (load average at the end %.1f)" % (time.time() - t0, os.getloadavg()[0]))
    benchlib.write_json(a, report)


if __name__ == "__main__":
    main()
