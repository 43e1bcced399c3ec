"""Attention written from its definition, in float64, one sequence and one head at a time: the
reference of the reliability, property and stress tests (not a test module itself).

out[i] = sum_j softmax_j(scale * q[i] . k[j] over the keys j that query i sees) * v[j]; a query
that sees no key gives zeros. GQA: query head h reads kv head h // (q_heads / kv_heads).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch


def attend(q, k, v, visible, scale: float, bias=None) -> torch.Tensor:
    """q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv], visible bool [n, m] (bias: additive [n, m])
    -> float64 [n, Hq, Dv]."""
    q, k, v = q.double(), k.double(), v.double()
    n, q_heads, _ = q.shape
    group = q_heads // k.shape[1]
    out = torch.zeros(n, q_heads, v.shape[-1], dtype=torch.float64)
    sees_a_key = visible.any(-1)
    if k.shape[0] == 0 or not sees_a_key.any():
        return out  # a row that sees no key is zero
    for h in range(q_heads):
        scores = scale * (q[:, h] @ k[:, h // group].T)  # [n, m]
        if bias is not None:
            scores = scores + bias.double()
        # softmax over the visible keys, written out (exp(s - max) / sum)
        scores = scores.masked_fill(~visible, -math.inf)
        top = scores.amax(dim=-1, keepdim=True).clamp_min(-1e300)  # rows seeing no key: finite
        weights = (scores - top).exp()
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-300)
        out[:, h] = weights @ v[:, h // group]
    return out


def gather_tokens(pool, pages: Sequence[int], length: int) -> torch.Tensor:
    """Tokens 0..length-1 of a sequence whose pages are ``pages``: token t sits in slot
    t % page_size of page pages[t // page_size]. pool [P, S, H, D] -> [length, H, D]."""
    page_size = pool.shape[1]
    positions = torch.arange(length)
    page_ids = torch.tensor(list(pages), dtype=torch.long)[positions // page_size]
    return pool[page_ids, positions % page_size]


def paged_reference(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start_loc,
    is_causal: bool,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """The paged call's definition: q [T, Hq, D] packs each sequence's new tokens; new token i of
    a sequence of length L with n new tokens sits at position L - n + i."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    starts = query_start_loc.tolist()
    outs: List[torch.Tensor] = []
    for b, length in enumerate(seq_lens.tolist()):
        rows = q[starts[b] : starts[b + 1]]
        n = rows.shape[0]
        pages = block_table[b].tolist()
        k = gather_tokens(k_cache, pages, length)
        v = gather_tokens(v_cache, pages, length)
        positions = torch.arange(length - n, length).view(n, 1)
        keys = torch.arange(length).view(1, length)
        visible = (keys <= positions) if is_causal else torch.ones(n, length, dtype=torch.bool)
        outs.append(attend(rows, k, v, visible, scale))
    return torch.cat(outs) if outs else torch.zeros(0, q.shape[1], v_cache.shape[-1])


def dense_reference(q, k, v, is_causal: bool, attn_mask=None, scale: Optional[float] = None):
    """The dense call's definition over BLHD q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; is_causal
    aligns top-left (query i sees keys j <= i); attn_mask broadcasts to [B, Hq, Lq, Lk], bool
    (True = attend) or additive."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    batch, q_len, q_heads, _ = q.shape
    kv_len = k.shape[1]
    out = torch.zeros(batch, q_len, q_heads, v.shape[-1], dtype=torch.float64)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool)
    if is_causal:
        causal = causal.tril()
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(batch, q_heads, q_len, kv_len)
    for b in range(batch):
        for h in range(q_heads):
            visible, bias = causal, None
            if mask is not None and mask.dtype == torch.bool:
                visible = visible & mask[b, h]
            elif mask is not None:
                bias = mask[b, h]
                visible = visible & (bias != -math.inf)
            head = attend(
                q[b, :, h : h + 1],
                k[b, :, [h // (q_heads // k.shape[2])]],
                v[b, :, [h // (q_heads // k.shape[2])]],
                visible,
                scale,
                bias,
            )
            out[b, :, h] = head[:, 0]
    return out


def assert_close_to_reference(out, ref, dtype=None):
    """Tolerances fit for the output's dtype (float32 here; bf16/fp16 looser)."""
    dtype = dtype or out.dtype
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}.get(dtype, 5e-3)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output holds NaN or inf"
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)
