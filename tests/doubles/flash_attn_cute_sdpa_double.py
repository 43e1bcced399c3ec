"""TEST DOUBLE for FlashAttention-4 (``flash_attn.cute``) — not FlashAttention-4.

It has FlashAttention-4's Python signatures (``flash_attn_func`` and ``flash_attn_varlen_func``,
each returning ``(out, lse)``) and semantics (BLHD or packed THD layout, GQA, causal mask aligned
bottom-right against ``seqused_k``, paged KV cache of any page size read through
``page_table``), computed with SDPA. Like the real package it is plain Python that torch cannot
trace: no torch op of its own. Tests install it as ``sys.modules["flash_attn.cute"]`` where the
real package cannot be installed; the device tests run the real one.
"""

import torch

from .flash_attn_sdpa_double import _attend, _window

__version__ = "4.0.0b0+sdpa-test-double"
calls = {"dense": 0, "varlen": 0}  # how often each entry point ran (tests read it)


def flash_attn_func(
    q,
    k,
    v,
    qv=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    **unsupported,
):
    assert qv is None and not any(unsupported.values()), unsupported
    calls["dense"] += 1
    lq, lk = q.shape[1], k.shape[1]
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    visible = (
        (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    )
    visible = _window(visible, i, j, lk - lq, window_size)
    return _attend(q, k, v, visible[None], softmax_scale, softcap or 0.0)


def flash_attn_varlen_func(
    q,
    k,
    v,
    qv=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    min_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    gather_kv_indices=None,
    page_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    softcap=0.0,
    **unsupported,
):
    assert qv is None and cu_seqlens_k is None and seqused_q is None
    assert page_table is not None and seqused_k is not None, "the double reads a paged cache only"
    assert page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    calls["varlen"] += 1
    batch = page_table.shape[0]
    pages = page_table.long()
    keys = k[pages].reshape(batch, -1, *k.shape[2:])
    values = v[pages].reshape(batch, -1, *v.shape[2:])
    lens = seqused_k.long()
    if q.dim() == 4:  # [B, Lq, Hq, D]: every sequence has Lq new tokens
        q_lens = torch.full_like(lens, q.shape[1])
        per_seq = list(q)
    else:  # packed [T, Hq, D] with cu_seqlens_q
        starts = cu_seqlens_q.long().tolist()
        q_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])], device=q.device)
        per_seq = [q[a:b] for a, b in zip(starts, starts[1:])]
    outs, lses = [], []
    for b, q_b in enumerate(per_seq):
        lq = q_b.shape[0]
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(keys.shape[1], device=q.device)[None, :]
        visible = j < lens[b]
        if causal:
            visible = visible & (j <= lens[b] - q_lens[b] + i)
        visible = _window(visible, i, j, lens[b] - q_lens[b], window_size)
        out_b, lse_b = _attend(
            q_b[None], keys[b : b + 1], values[b : b + 1], visible[None], softmax_scale, softcap
        )
        outs.append(out_b[0])
        lses.append(lse_b[0])  # [H, lq]
    if q.dim() == 4:  # [B, H, Lq]
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, dim=1)  # packed: lse [H, T]
