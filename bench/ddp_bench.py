#!/usr/bin/python3
"""dtrain DDP vs PyTorch's Python DDP: the same GPT (same initial weights), data, data order, batch
and optimizer; world size 2, one intra-op thread per rank, Gloo over loopback; run alternately in
one invocation. Prints the median step time and peak RSS per rank of each, and the ratios.

    /usr/bin/python3 bench/ddp_bench.py                 # after scripts/build.sh
    /usr/bin/python3 bench/ddp_bench.py --layers 2 --d-model 64 --seq-len 64 --steps 80
"""
import benchlib


def main():
    a = benchlib.common_args(__doc__).parse_args()
    summary, runs = benchlib.run_all(a, [
        ("dtrain", lambda m: benchlib.dtrain_cmd(a, "ddp", m)),
        ("pytorch", lambda m: benchlib.pytorch_cmd(a, m)),
    ])
    d, p = summary["dtrain"], summary["pytorch"]
    benchlib.header(a, "DDP benchmark")
    print("same work: first 3 losses agree to %.1e (relative)" % benchlib.same_work(summary, "dtrain", "pytorch"))
    print("%-22s %14s %16s" % ("", "step time (ms)", "peak RSS/rank (MiB)"))
    print("%-22s %14.1f %16.0f" % ("dtrain DDP (C++)", d["step_time_ms"], d["peak_rss_mib"]))
    print("%-22s %14.1f %16.0f" % ("PyTorch DDP (Python)", p["step_time_ms"], p["peak_rss_mib"]))
    ratio_time, ratio_rss = d["step_time_ms"] / p["step_time_ms"], d["peak_rss_mib"] / p["peak_rss_mib"]
    print("%-22s %14.2f %16.2f" % ("ratio dtrain/PyTorch", ratio_time, ratio_rss))
    benchlib.write_json(a, {"summary": summary, "runs": runs, "ratio_step_time": ratio_time, "ratio_peak_rss": ratio_rss})


if __name__ == "__main__":
    main()
