#!/usr/bin/python3
"""ZeRO benchmark: dtrain ZeRO-1 and ZeRO-2 against PyTorch's ZeroRedundancyOptimizer (+ DDP, Gloo)
and against dtrain DDP, on the same GPT, data, batch and AdamW; alternating in one run. Reports
step time, peak RSS per rank and the optimizer state held per rank (expected: about 1/W of DDP's).

    /usr/bin/python3 bench/zero_bench.py                 # after scripts/build.sh
    /usr/bin/python3 bench/zero_bench.py --world 3 --d-model 256
"""
import benchlib


def main():
    a = benchlib.common_args(__doc__).parse_args()
    contenders = [
        ("dtrain-ddp", lambda m: benchlib.dtrain_cmd(a, "ddp", m)),
        ("dtrain-zero1", lambda m: benchlib.dtrain_cmd(a, "zero1", m)),
        ("dtrain-zero2", lambda m: benchlib.dtrain_cmd(a, "zero2", m)),
        ("pytorch-zero1", lambda m: benchlib.pytorch_cmd(a, m, ["--zero"])),
    ]
    summary, runs = benchlib.run_all(a, contenders)
    benchlib.header(a, "ZeRO benchmark")
    print("same work: first 3 losses of dtrain-zero1 and pytorch-zero1 agree to %.1e (relative)" %
          benchlib.same_work(summary, "dtrain-zero1", "pytorch-zero1"))
    ddp_state = summary["dtrain-ddp"]["optimizer_state_mib"]
    print("%-15s %14s %18s %22s %16s" % ("", "step time (ms)", "peak RSS/rank (MiB)", "optimizer state/rank (MiB)",
                                          "state vs DDP"))
    for name, _ in contenders:
        s = summary[name]
        print("%-15s %14.1f %18.0f %22.2f %16.2f" % (name, s["step_time_ms"], s["peak_rss_mib"], s["optimizer_state_mib"],
                                                  s["optimizer_state_mib"] / ddp_state))
    print("expected optimizer state vs DDP: about 1/W = %.2f" % (1.0 / a.world))
    benchlib.write_json(a, {"summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
