"""Implementations of astr::flash_dense and astr::flash_paged over the flash-attn package's own
Python API, registered with the dispatcher once the probe has found the package.

They are CompositeImplicitAutograd kernels written in Python: the package's functions carry
their own autograd (and, from flash-attn 2.7 on, fake kernels), so training calls are
differentiable and the calls trace under torch.compile.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Optional

import torch

_LIBRARY: Optional[torch.library.Library] = None


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def _paged_kwarg(function) -> str:
    """FlashAttention-2 names the page table ``block_table``; FlashAttention-3 ``page_table``."""
    parameters = inspect.signature(function).parameters
    return "block_table" if "block_table" in parameters else "page_table"


def _left_padded(q, query_start_loc, max_query_len, batch):
    """Scatter packed q ``[T, Hq, D]`` into ``[B, max_q, Hq, D]`` with each sequence's new
    tokens at the end of its row. flash-attn's KV-cache path aligns the causal mask
    bottom-right against ``cache_seqlens``, so a left-padded token j of a sequence with q_len
    new tokens lands at position ``seq_len - q_len + j``: astr's convention."""
    tokens = q.shape[0]
    starts = query_start_loc.long()
    q_len = starts[1:] - starts[:-1]
    token = torch.arange(tokens, device=q.device)
    seq = torch.searchsorted(starts[1:], token, right=True).clamp(max=batch - 1)
    pos = (token - starts[seq] + (max_query_len - q_len[seq])).clamp(0, max_query_len - 1)
    padded = q.new_zeros(batch, max_query_len, q.shape[1], q.shape[2])
    padded[seq, pos] = q
    return padded, seq, pos


def register(module: ModuleType) -> None:
    """Point astr::flash_dense / astr::flash_paged at ``module``'s flash_attn_func and
    flash_attn_with_kvcache (FlashAttention-2 and -3 share these names)."""
    global _LIBRARY
    dense_fn = module.flash_attn_func
    kvcache_fn = getattr(module, "flash_attn_with_kvcache", None)

    def flash_dense(q, k, v, is_causal: bool, scale: float):
        # q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D]
        return _first(dense_fn(q, k, v, softmax_scale=scale, causal=is_causal))

    def flash_paged(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        decode: bool,
        is_causal: bool,
        scale: float,
    ):
        # q [T, Hq, D]; caches [P, S, Hkv, D]; block_table int32 [B, W]; seq_lens int32 [B]
        if kvcache_fn is None:
            raise RuntimeError(f"flash backend: {module.__name__} has no flash_attn_with_kvcache")
        batch = seq_lens.shape[0]
        if decode:
            padded, seq, pos = q.view(batch, 1, q.shape[1], q.shape[2]), None, None
        else:
            padded, seq, pos = _left_padded(q, query_start_loc, max_query_len, batch)
        out = _first(
            kvcache_fn(
                padded,
                k_cache,
                v_cache,
                cache_seqlens=seq_lens,
                softmax_scale=scale,
                causal=is_causal,
                **{_paged_kwarg(kvcache_fn): block_table},
            )
        )
        return out.view(q.shape[0], q.shape[1], -1) if decode else out[seq, pos]

    if _LIBRARY is not None:  # a new probe (tests) replaces the earlier registration
        _LIBRARY._destroy()
    _LIBRARY = torch.library.Library("astr", "IMPL")
    _LIBRARY.impl("flash_dense", flash_dense, "CompositeImplicitAutograd")
    _LIBRARY.impl("flash_paged", flash_paged, "CompositeImplicitAutograd")
