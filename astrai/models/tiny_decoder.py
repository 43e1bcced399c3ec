"""A small decoder-only transformer (GQA, rotary positions, RMSNorm, SwiGLU) whose attention is
``astrai.extension.attention``: dense for training, paged KV cache for prefill and decode.
Randomly initialised; it exists to exercise the attention layer the way a real model does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from astrai.extension import PagedKVCache, attention


@dataclass
class DecoderConfig:
    vocab_size: int = 512
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    mlp_hidden: int = 512
    rope_theta: float = 10000.0
    # Large logits make greedy decoding robust to rounding, so backends can be compared token
    # by token in bf16.
    logit_scale: float = 8.0


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of channels of x ``[..., T, heads, head_dim]`` by position ``[T]``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]  # [T, half]
    cos = angles.cos()[:, None, :]
    sin = angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_id: int):
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        c = config
        self.wq = nn.Linear(c.dim, c.num_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.num_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.num_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x, positions, kv_cache=None, fwd=None, backend=None):
        # x [B, L, dim]; positions [L] (training) or [T] with B == 1 (packed cache step)
        c = self.config
        b, length, _ = x.shape
        q = self.wq(x).view(b, length, c.num_heads, c.head_dim)
        k = self.wk(x).view(b, length, c.num_kv_heads, c.head_dim)
        v = self.wv(x).view(b, length, c.num_kv_heads, c.head_dim)
        q = rotary(q, positions, c.rope_theta)
        k = rotary(k, positions, c.rope_theta)
        out = attention(
            q,
            k,
            v,
            kv_cache=kv_cache,
            layer_id=self.layer_id,
            is_causal=True,
            fwd=fwd,
            backend=backend,
        )
        return self.wo(out.reshape(b, length, -1))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig, layer_id: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim)
        self.attn = Attention(config, layer_id)
        self.mlp_norm = nn.RMSNorm(config.dim)
        self.gate_up = nn.Linear(config.dim, 2 * config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.dim, bias=False)

    def forward(self, x, positions, kv_cache=None, fwd=None, backend=None):
        x = x + self.attn(self.attn_norm(x), positions, kv_cache, fwd, backend)
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyDecoder(nn.Module):
    def __init__(self, config: Optional[DecoderConfig] = None):
        super().__init__()
        self.config = config or DecoderConfig()
        c = self.config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        self.norm = nn.RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training forward: tokens ``[B, L]`` -> logits ``[B, L, vocab]`` (dense, causal)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self._run(tokens, positions)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        fwd: str,
        backend=None,
    ) -> torch.Tensor:
        """One inference step over the paged cache: the new tokens of every sequence packed as
        ``[T]`` with their positions ``[T]`` (after ``kv_cache.begin_step``) -> logits
        ``[T, vocab]``."""
        return self._run(tokens[None], positions, kv_cache, fwd, backend)[0]

    def _run(self, tokens, positions, kv_cache=None, fwd=None, backend=None):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions, kv_cache, fwd, backend)
        # Logits in float32: bf16 logits are spaced 0.125 apart near 16, which turns greedy
        # decoding into a coin toss between near-equal tokens.
        hidden = self.norm(x).float()
        return F.linear(hidden, self.lm_head.weight.float()) * self.config.logit_scale

    def make_cache(self, num_pages: int, page_size: int, dtype=None, device=None) -> PagedKVCache:
        c = self.config
        weight = self.lm_head.weight
        return PagedKVCache(
            c.num_layers,
            num_pages,
            page_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
        )
