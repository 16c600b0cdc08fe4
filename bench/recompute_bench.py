#!/usr/bin/python3
"""Activation checkpointing: peak memory and step time of the demo GPT with and without
recomputation (and with bf16 autocast), one process, alternating in one run.

    /usr/bin/python3 bench/recompute_bench.py      # 8 layers, d_model 256, seq 512, batch 8

Peak RSS is the process's high-water mark; the difference between the runs is the activation
memory that recomputation saves (what remains is about one block's activations plus the block
inputs, as expected).
"""
import benchlib


def main():
    ap = benchlib.common_args(__doc__)
    ap.set_defaults(world=1, layers=8, d_model=256, seq_len=512, batch_size=8, steps=8, warmup=2, repeats=2)
    a = ap.parse_args()
    contenders = [
        ("fp32", lambda m: benchlib.dtrain_cmd(a, "single", m)),
        ("fp32+ckpt", lambda m: benchlib.dtrain_cmd(a, "single", m, ["--activation-checkpointing"])),
        ("bf16", lambda m: benchlib.dtrain_cmd(a, "single", m, ["--precision", "bf16"])),
        ("bf16+ckpt", lambda m: benchlib.dtrain_cmd(a, "single", m, ["--precision", "bf16", "--activation-checkpointing"])),
    ]
    summary, runs = benchlib.run_all(a, contenders)
    benchlib.header(a, "Activation checkpointing benchmark")
    base = summary["fp32"]
    # Activations kept without recomputation, per layer: the saved tensors of a pre-LN block are
    # roughly 16 x (batch x seq x d_model) floats plus the attention maps 2 x (batch x heads x seq x seq).
    b, t, c, h = a.batch_size, a.seq_len, a.d_model, a.heads
    per_layer_mib = (16 * b * t * c + 2 * b * h * t * t) * 4 / 2**20
    print("rough estimate of fp32 activations per block: %.0f MiB (x %d blocks = %.0f MiB)" %
          (per_layer_mib, a.layers, per_layer_mib * a.layers))
    print("%-10s %14s %16s %22s %14s" % ("", "step time (ms)", "peak RSS (MiB)", "RSS saved vs fp32 (MiB)", "time vs fp32"))
    for name, _ in contenders:
        s = summary[name]
        print("%-10s %14.0f %16.0f %22.0f %14.2f" % (name, s["step_time_ms"], s["peak_rss_mib"],
                                                 base["peak_rss_mib"] - s["peak_rss_mib"],
                                                 s["step_time_ms"] / base["step_time_ms"]))
    benchlib.write_json(a, {"summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
