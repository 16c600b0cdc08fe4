"""Kernel profiles of dtrain and PyTorch side by side (bench/gpu_bench.py --profile).

A profile is the JSON dtrain writes under DTRAIN_PROFILE=PATH[@FIRST:LAST] (util/step_profile.h):
{"steps": n, "events": [{"name", "device": "cuda"|"cpu", "count", "total_us"}]}, summed by name.
from_chrome_trace() makes the same from a torch.profiler trace (bench/gpu_peer.py --profile).

  python3 bench/profile_summary.py OURS.json THEIRS.json [--top 15]
"""
import argparse
import json
import re

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

# Kernel families by name (first match wins), for the per-family totals.
FAMILIES = [("gemm", r"gemm|cutlass|nvjet|xmma|sm90_|cublas"), ("attention", r"flash|fmha|attention|sdpa"),
            ("nccl", r"nccl"), ("copy", r"memcpy|memset|Memcpy|Memset|copy_kernel|CatArrayBatched"),
            ("adam/foreach", r"multi_tensor|foreach|adam", ), ("norm", r"layer_norm|LayerNorm|norm"),
            ("reduce", r"reduce_kernel|Reduce"), ("elementwise", r"elementwise|vectorized|unrolled")]


def from_chrome_trace(trace_path, steps):
    with open(trace_path) as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace  # (1.13 writes a bare list)
    sums = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        device = "cuda" if e.get("cat") in GPU_CATS else "cpu"
        c = sums.setdefault((e.get("name", "?"), device), [0, 0.0])
        c[0] += 1
        c[1] += float(e["dur"])
    rows = [{"name": n, "device": d, "count": c, "total_us": t} for (n, d), (c, t) in sums.items()]
    rows.sort(key=lambda r: -r["total_us"])
    return {"steps": steps, "events": rows}


def load(path):
    """The profile at `path`, or None where it is missing or unreadable (a contender that failed)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def family(name):
    for fam, pattern in FAMILIES:
        if re.search(pattern, name):
            return fam
    return "other"


def digest(profile, top=15):
    """Per step: GPU time and kernel count, the families' times, the top kernels."""
    steps = max(1, profile.get("steps", 1))
    gpu = [e for e in profile["events"] if e["device"] == "cuda"]
    fams = {}
    for e in gpu:
        fams[family(e["name"])] = fams.get(family(e["name"]), 0.0) + e["total_us"] / steps
    return {"gpu_ms_per_step": sum(e["total_us"] for e in gpu) / steps / 1000.0,
            "kernels_per_step": sum(e["count"] for e in gpu) / steps,
            "families_ms": {k: v / 1000.0 for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
            "top": [{"name": e["name"][:90], "ms_per_step": e["total_us"] / steps / 1000.0,
                     "calls_per_step": e["count"] / steps} for e in gpu[:top]]}


def print_side_by_side(ours_name, ours, theirs_name, theirs):
    print("profile %s vs %s: GPU time per step %.1f vs %.1f ms, kernels per step %.0f vs %.0f" % (
        ours_name, theirs_name, ours["gpu_ms_per_step"], theirs["gpu_ms_per_step"],
        ours["kernels_per_step"], theirs["kernels_per_step"]))
    fams = list(dict.fromkeys(list(ours["families_ms"]) + list(theirs["families_ms"])))
    for f in fams:
        print("  %-13s %8.2f ms  %8.2f ms" % (f, ours["families_ms"].get(f, 0.0), theirs["families_ms"].get(f, 0.0)))
    for label, d in ((ours_name, ours), (theirs_name, theirs)):
        print("  top kernels, %s (ms/step, calls/step):" % label)
        for k in d["top"]:
            print("    %7.2f %6.0f  %s" % (k["ms_per_step"], k["calls_per_step"], k["name"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("theirs")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    print_side_by_side(a.ours, digest(load(a.ours), a.top), a.theirs, digest(load(a.theirs), a.top))


if __name__ == "__main__":
    main()
