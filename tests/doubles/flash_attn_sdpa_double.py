"""TEST DOUBLE for the flash-attn package — not flash-attn.

It has FlashAttention-2's Python signatures (``flash_attn_func``, ``flash_attn_with_kvcache``)
and semantics (BLHD layout, GQA, causal mask aligned bottom-right, ``window_size=(left, right)``
counted from that edge, ``softcap``, the log-sum-exp as ``[B, H, L]``, paged KV cache read through
``block_table`` with ``cache_seqlens``, pages a multiple of 256 tokens), computed with SDPA or,
for a softcap or the log-sum-exp, written out.
Tests install it as ``sys.modules["flash_attn"]`` to exercise astrai's flash wiring where the
real package cannot be installed.
"""

import torch
import torch.nn.functional as F

__version__ = "2.8.3+sdpa-test-double"


def _attend(q, k, v, visible, scale, softcap=0.0):
    """(out [B, Lq, Hq, D], lse [B, Hq, Lq]) with the scores written out (float32)."""
    group = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(group, dim=2).float()
    vv = v.repeat_interleave(group, dim=2).float()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = torch.einsum("bihd,bjhd->bhij", q.float(), kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vv).to(q.dtype).contiguous()
    return out, lse.contiguous()


def _window(visible, i, j, offset, window_size):
    """Apply window_size=(left, right) around the bottom-right aligned diagonal j = i + offset."""
    left, right = window_size
    if left is not None and left >= 0:
        visible = visible & (j >= i + offset - left)
    if right is not None and right >= 0:
        visible = visible & (j <= i + offset + right)
    return visible


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
    assert dropout_p == 0.0 and alibi_slopes is None
    lq, lk = q.shape[1], k.shape[1]
    i = torch.arange(lq, device=q.device)[:, None]
    j = torch.arange(lk, device=q.device)[None, :]
    visible = (
        (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    )
    visible = _window(visible, i, j, lk - lq, window_size)
    if softcap > 0 or return_attn_probs:
        out, lse = _attend(q, k, v, visible[None], softmax_scale, softcap)
        return (out, lse, None) if return_attn_probs else out
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
    visible = _window(visible, i, j, lens - lq, window_size)
    if softcap > 0 or return_softmax_lse:
        out, lse = _attend(q, keys, values, visible, softmax_scale, softcap)
        return (out, lse) if return_softmax_lse else out
    return _sdpa(q, keys, values, visible, softmax_scale)
