"""TEST DOUBLE for the flash-attn package — not flash-attn.

It has FlashAttention-2's Python signatures (``flash_attn_func``, ``flash_attn_with_kvcache``)
and semantics (BLHD layout, GQA, causal mask aligned bottom-right, paged KV cache read through
``block_table`` with ``cache_seqlens``, pages a multiple of 256 tokens), computed with SDPA.
Tests install it as ``sys.modules["flash_attn"]`` to exercise astrai's flash wiring where the
real package cannot be installed.
"""

import torch
import torch.nn.functional as F

__version__ = "2.8.3+sdpa-test-double"


def _sdpa(q, k, v, visible, scale):
    # q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], visible bool [B or 1, Lq, Lk]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    out = out.transpose(1, 2)
    return torch.where(
        visible.any(-1)[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device)
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    lq, lk = q.shape[1], k.shape[1]
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    visible = (
        (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    )
    return _sdpa(q, k, v, visible[None], softmax_scale)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    assert k is None and v is None, "the double does not append"
    batch, lq = q.shape[:2]
    if block_table is not None:
        assert k_cache.shape[1] % 256 == 0, "FlashAttention-2 paged KV needs 256-token pages"
        pages = block_table.long()
        keys = k_cache[pages].reshape(batch, -1, *k_cache.shape[2:])
        values = v_cache[pages].reshape(batch, -1, *v_cache.shape[2:])
    else:
        keys, values = k_cache, v_cache
    lk = keys.shape[1]
    lens = cache_seqlens.long()[:, None, None]
    i = torch.arange(lq, device=q.device)[None, :, None]
    j = torch.arange(lk, device=q.device)[None, None, :]
    visible = j < lens
    if causal:
        visible = visible & (j <= lens - lq + i)
    return _sdpa(q, keys, values, visible, softmax_scale)
