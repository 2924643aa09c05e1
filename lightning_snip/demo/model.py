"""A small Llama-style byte-level language model: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Linear layers are named q/k/v/o (attention) and gate/up/down (MLP), plus lm_head, as in Llama.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 256  # bytes
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    hidden_dim: int = 352  # SwiGLU width; a multiple of 32 so every MX/NVFP4 block fits
    max_seq_len: int = 512
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "hidden_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name}: invalid value {getattr(self, name)!r}; allowed: an integer > 0")
        # Two fields disagree: the message names the one the user changed (the other at its default).
        changed = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        for small, large in (("num_heads", "dim"), ("num_kv_heads", "num_heads")):
            a, b = getattr(self, small), getattr(self, large)
            if b % a and small in changed and large not in changed:
                raise ValueError(f"model.{small}: {a} does not divide model.{large} {b}; allowed: a divisor of {b}")
            if b % a:
                raise ValueError(f"model.{large}: {b} is not a multiple of model.{small} {a}; allowed: a multiple of {a}")
        if (self.dim // self.num_heads) % 2:
            raise ValueError(f"model.dim: {self.dim} gives an odd head size {self.dim // self.num_heads} "
                             f"(model.num_heads {self.num_heads}); allowed: dim / num_heads even (RoPE rotates pairs)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), freqs)  # (T, head_dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # x: (B, heads, T, head_dim); rotate pairs (even, odd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.dim // cfg.num_heads
        self.q = nn.Linear(cfg.dim, cfg.num_heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.num_kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.num_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab)."""
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
