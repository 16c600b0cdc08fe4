"""The GPT of dtrain (include/dtrain/models/gpt.h) in plain PyTorch: a byte-level, decoder-only,
pre-LayerNorm GPT-2-style transformer with the same parameter names, shapes, initialisation and
forward as the C++ dtrain::models::GPT, so the benchmark compares dtrain against PyTorch's Python
DDP on the same model, and tests/models/make_gpt_golden.py can check that the two agree.

    model = GPT(GPTConfig(seq_len=128, layers=4, d_model=256, heads=4))
    init_weights(model, seed=0)          # what the C++ constructor does with GPTOptions().seed(0)
    logits = model(tokens)               # tokens int64 [B, T] -> [B, T, vocab_size]
    loss = gpt_loss(logits, targets)

Written as straightforward, idiomatic torch.nn, the way a Python user would: attention through
F.scaled_dot_product_attention (causal) where torch has it (2.0+, cfg.fused_attention, as in
dtrain's GPTOptions::fused_attention), the math form otherwise.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 256       # maximum sequence length (learned positions)
    layers: int = 4
    d_model: int = 256
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    fused_attention: bool = True  # F.scaled_dot_product_attention where torch has it (2.0+)


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.heads == 0
        c = cfg.d_model
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(c, eps=1e-5)
        self.qkv = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c, eps=1e-5)
        self.fc = nn.Linear(c, cfg.mlp_ratio * c)
        self.mlp_proj = nn.Linear(cfg.mlp_ratio * c, c)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.fused = cfg.fused_attention and hasattr(F, "scaled_dot_product_attention")
        self.p_attn = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self._mask = None  # cached causal mask; not a buffer (never saved nor broadcast)

    def causal_mask(self, t, device):
        if self._mask is None or self._mask.size(0) < t or self._mask.device != device:
            self._mask = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
        return self._mask[:t, :t]

    def forward(self, x):
        b, t, c = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, h, c // h).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        if self.fused:
            p = self.p_attn if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
            att = att.masked_fill(self.causal_mask(t, x.device), float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.resid_drop(self.attn_proj(y))
        x = x + self.resid_drop(self.mlp_proj(F.gelu(self.fc(self.ln2(x)))))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([GPTBlock(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied
        init_weights(self, 0)

    def forward(self, tokens):
        b, t = tokens.shape
        assert t <= self.cfg.seq_len, "sequence longer than seq_len"
        x = self.drop(self.tok_emb(tokens) + self.pos_emb.weight[:t])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def init_weights(model: GPT, seed: int = 0):
    """The C++ GPTImpl::init_weights(seed): biases 0, LayerNorm weights 1, other weights
    normal(0, 0.02) (residual projections 0.02 / sqrt(2 * layers)), drawn in named_parameters()
    order from one CPU generator, in float32, then copied onto the parameter's device."""
    g = torch.Generator()
    g.manual_seed(seed)
    std_resid = 0.02 / math.sqrt(2.0 * max(model.cfg.layers, 1))
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif name.endswith(("ln1.weight", "ln2.weight")) or name == "ln_f.weight":
            p.fill_(1.0)
        else:
            sd = std_resid if name.endswith(("attn_proj.weight", "mlp_proj.weight")) else 0.02
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, sd, generator=g))
