"""Tensor parallelism (dtrain-gpt --tp): bytes each rank sends per step against Megatron-LM's
formulas, and tokens/s and memory per rank of TP2 against DDP and FSDP at W = 2.

    /usr/bin/python3 bench/tensor_parallel_bench.py             # both parts (about 4 minutes on 2 cores)
    /usr/bin/python3 bench/tensor_parallel_bench.py --part bytes

Bytes: the metrics field comm_mib_sent (comm/traffic.h): what rank 0 sent in a step by ring
algorithms, 2 (n-1)/n of each all-reduce's payload, (n-1)/n of each all-gather's and
reduce-scatter's. Megatron-LM's count for tensor parallelism (Korthikanti et al. 2022, section 4):
per transformer layer 4 all-reduces of b s h activations (2 forward, 2 backward), or with sequence
parallelism 4 all-gathers and 4 reduce-scatters of the same size, the same bytes. Around the layers
dtrain adds: TP, the vocabulary-parallel embedding's all-reduce and the head input's all-reduce in
backward (4 (n-1)/n b s h); SP, that embedding all-reduce, the all-gather of its scatter in backward
and the head's all-gather and reduce-scatter (5 (n-1)/n b s h). Left out of the formula (they make
the small remainder): the cross-entropy's 3 all-reduces of b s values, the LayerNorm and bias
gradients of sequence parallelism, the step report.

Peer: none runs here (PyTorch 1.13 has no DTensor tensor parallelism; it came with 2.0+).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = benchlib.ROOT


def run(world, flags, steps, warmup):
    tmp = tempfile.mkdtemp(prefix="dtrain-tp-bench-")
    metrics = os.path.join(tmp, "m.jsonl")
    launch = ["build/bin/dtrun", "--standalone", "--nproc-per-node", str(world), "--allocator", "system",
              "--bind-cores", "off"] if world > 1 else []  # (as the recorded figures ran)
    cmd = launch + ["build/bin/dtrain-gpt", "--threads", "1", "--steps", str(steps), "--metrics", metrics] + flags
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace")
    if res.returncode != 0:
        sys.exit("benchmark command failed (%d): %s\n%s" % (res.returncode, " ".join(cmd), res.stdout[-3000:]))
    steps_, final = benchlib.read_metrics(metrics)
    timed = steps_[warmup:]
    return {"cmd": " ".join(cmd), "tokens_per_s": statistics.median(s["tokens_per_s"] for s in timed),
            "step_ms": 1000 * statistics.median(s["step_time_s"] for s in timed),
            "sent_mib": statistics.median(s["comm_mib_sent"] for s in timed),
            "peak_rss_mib": max(final["peak_rss_mib_per_rank"]), "params": final["parameters"]}


def formula_mib(layers, b, s, h, n, sp):
    share = (n - 1) / n
    act = b * s * h * 4  # bytes of one fp32 activation tensor [b, s, h]
    per_layer = 8 * share * act if sp else 4 * 2 * share * act  # (the same bytes)
    around = (5 if sp else 4) * share * act
    return (layers * per_layer + around) / 2**20


def part_bytes(a):
    layers, h, s, b = 4, 128, 128, 8
    print("\nBytes sent per step by rank 0 (comm_mib_sent) against Megatron's formula: GPT %d layers, d_model %d, "
          "seq %d, batch %d per data-parallel rank, fp32" % (layers, h, s, b))
    print("| run | measured MiB/step | formula MiB/step | measured / formula |")
    print("|---|---|---|---|")
    model = ["--layers", str(layers), "--d-model", str(h), "--heads", "4", "--seq-len", str(s), "--batch-size", str(b)]
    for n, sp in ((2, False), (2, True), (4, False), (4, True)):
        r = run(n, model + ["--strategy", "single", "--tp", str(n), "--global-batch-size", str(b)] +
                (["--sequence-parallel"] if sp else []), 4, 1)
        f = formula_mib(layers, b, s, h, n, sp)
        print("| tp %d%s | %.3f | %.3f | %.3f |" % (n, " + sp" if sp else "", r["sent_mib"], f, r["sent_mib"] / f),
              flush=True)
    for name, flags in (("ddp", ["--strategy", "ddp"]), ("fsdp", ["--strategy", "fsdp"])):
        r = run(2, model + flags, 4, 1)
        p = r["params"] * 4 / 2**20
        f = p if name == "ddp" else 1.5 * p  # 2 (n-1)/n P; fsdp: 2 all-gathers + 1 reduce-scatter of P, (n-1)/n each
        print("| %s (W = 2; formula from the %.2f MiB of parameters) | %.3f | %.3f | %.3f |" % (name, p, r["sent_mib"], f,
                                                                                           r["sent_mib"] / f), flush=True)


def part_speed(a):
    for title, model, heads in (("the demo model: GPT 4 layers, d_model 128, seq 128", ["--layers", "4", "--d-model", "128",
                                                                                       "--seq-len", "128"], 4),
                                ("a larger one: GPT 8 layers, d_model 512, seq 64", ["--layers", "8", "--d-model", "512",
                                                                                   "--seq-len", "64"], 8)):
        print("\nTokens/s and memory at W = 2, %s, global batch 8, %d steps (first %d untimed)" % (title, a.steps, a.warmup))
        print("| strategy | tokens/s | step | peak RSS/rank | sent MiB/step | vs FSDP |")
        print("|---|---|---|---|---|---|")
        m = model + ["--heads", str(heads)]
        runs = [("fsdp", ["--strategy", "fsdp", "--batch-size", "4"]),
                ("ddp", ["--strategy", "ddp", "--batch-size", "4"]),
                ("tp2", ["--strategy", "single", "--tp", "2", "--batch-size", "8", "--global-batch-size", "8"]),
                ("tp2 + sp", ["--strategy", "single", "--tp", "2", "--sequence-parallel", "--batch-size", "8",
                              "--global-batch-size", "8"])]
        res = {}
        for name, flags in runs:
            res[name] = r = run(2, m + flags, a.steps, a.warmup)
            print("| %s | %.0f | %.1f ms | %.0f MiB | %.2f | %.2f |" % (name, r["tokens_per_s"], r["step_ms"],
                                                                     r["peak_rss_mib"], r["sent_mib"],
                                                                     r["tokens_per_s"] / res["fsdp"]["tokens_per_s"]),
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "bytes", "speed"], default="all")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    print("tensor parallel bench: BLAS %s, 1 intra-op thread per rank, %d cores" % (benchlib.blas_name(), os.cpu_count()))
    if a.part in ("all", "bytes"):
        part_bytes(a)
    if a.part in ("all", "speed"):
        part_speed(a)


if __name__ == "__main__":
    main()
