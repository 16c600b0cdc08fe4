#!/usr/bin/python3
"""Writes tests/models/golden/gpt_forward.txt: logits and loss of bench/gpt_model.py's GPT (the
PyTorch twin of dtrain::models::GPT) for a fixed token batch, with (a) every parameter set by a
closed formula and (b) init_weights(seed). tests/models/gpt_test.cpp rebuilds both in C++ and
must match to 1e-5. Run once with the Debian torch: /usr/bin/python3 tests/models/make_gpt_golden.py

Formula (a), for the idx-th entry of named_parameters(), x = arange(numel) in float64:
  s = sin(0.37 * x + idx);  LayerNorm weight: 1 + 0.1 s;  bias: 0.1 s;  others: 0.1 s
(computed in float64, rounded to float32, reshaped row-major to the parameter's shape).
File format: one record per line, space separated:
  config vocab_size seq_len layers d_model heads mlp_ratio
  tokens B T v...      targets B T v...
  case NAME            (then, for that case:)
  loss VALUE           logit b t v VALUE (several)
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from gpt_model import GPT, GPTConfig, gpt_loss, init_weights  # noqa: E402


def is_ln_weight(name):
    return name.endswith(("ln1.weight", "ln2.weight")) or name == "ln_f.weight"


@torch.no_grad()
def set_formula(model):
    for idx, (name, p) in enumerate(model.named_parameters()):
        s = torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + idx)
        if is_ln_weight(name):
            v = 1.0 + 0.1 * s
        else:
            v = 0.1 * s
        p.copy_(v.to(torch.float32).view(p.shape))


def main():
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=256, seq_len=16, layers=2, d_model=32, heads=4, mlp_ratio=4)
    b, t = 3, 12
    tokens = (torch.arange(b * t, dtype=torch.int64) * 37 + 11).remainder(256).view(b, t)
    targets = (tokens * 7 + 3).remainder(256)
    picks = [0, 1, 32, 65, 101, 200, 255]

    lines = ["config %d %d %d %d %d %d" % (cfg.vocab_size, cfg.seq_len, cfg.layers, cfg.d_model,
                                            cfg.heads, cfg.mlp_ratio),
             "tokens %d %d %s" % (b, t, " ".join(str(int(v)) for v in tokens.flatten())),
             "targets %d %d %s" % (b, t, " ".join(str(int(v)) for v in targets.flatten()))]
    model = GPT(cfg).eval()
    for case in ("formula", "seed1234"):
        if case == "formula":
            set_formula(model)
        else:
            init_weights(model, 1234)
        with torch.no_grad():
            logits = model(tokens)
            loss = gpt_loss(logits, targets)
        lines.append("case %s" % case)
        lines.append("loss %.9g" % loss.item())
        for bi in range(b):
            for ti in range(t):
                for v in picks:
                    lines.append("logit %d %d %d %.9g" % (bi, ti, v, logits[bi, ti, v].item()))
    out = os.path.join(HERE, "golden", "gpt_forward.txt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
