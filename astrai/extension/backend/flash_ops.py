"""Implementations of astr::flash_dense and astr::flash_paged over the flash-attn package's own
Python API, registered with the dispatcher once the probe has found the package.

FlashAttention-2 and -3: CompositeImplicitAutograd kernels written in Python. The package's
functions carry their own autograd (and, from flash-attn 2.7 on, torch ops with fake kernels),
so training calls are differentiable and the calls trace under torch.compile.

FlashAttention-4 (flash_attn.cute) launches CUTLASS DSL kernels straight from Python, with no
torch op of its own, so tracing could not see through it: astrai's ops are then opaque kernels
(CPU and CUDA keys; the resolver only sends CUDA calls) with fake kernels and an autograd
formula registered here, and the graph keeps astr::flash_dense / astr::flash_paged as nodes.
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
    seq = (torch.searchsorted(starts, token, right=True) - 1).clamp(0, batch - 1)
    pos = (token - starts[seq] + (max_query_len - q_len[seq])).clamp(0, max_query_len - 1)
    padded = q.new_zeros(batch, max_query_len, q.shape[1], q.shape[2])
    padded[seq, pos] = q
    return padded, seq, pos


def register(module: ModuleType) -> None:
    """Point astr::flash_dense / astr::flash_paged at ``module``'s flash_attn_func and
    flash_attn_with_kvcache (FlashAttention-2 and -3 share these names)."""
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

    library = _new_library()
    library.impl("flash_dense", flash_dense, "CompositeImplicitAutograd")
    library.impl("flash_paged", flash_paged, "CompositeImplicitAutograd")


def _new_library() -> torch.library.Library:
    """A fresh registration; a new probe (tests) replaces the earlier one, fakes included."""
    global _LIBRARY
    if _LIBRARY is not None:
        _LIBRARY._destroy()
    _LIBRARY = torch.library.Library("astr", "IMPL")
    return _LIBRARY


def register_flash4(module: ModuleType) -> None:
    """Point astr::flash_dense / astr::flash_paged at FlashAttention-4's flash_attn_func and
    flash_attn_varlen_func (``page_table=`` for the paged cache, ``seqused_k`` for lengths).

    FlashAttention-4 reads whole pages when a page holds whole key tiles, and a NaN in an unused
    row of a sequence's last page would reach the output (0 * NaN): PagedKVCache's pools start
    zeroed and only ever hold written tokens, so they never hold one."""
    dense_fn = module.flash_attn_func
    varlen_fn = module.flash_attn_varlen_func

    def flash_dense(q, k, v, is_causal: bool, scale: float):
        return _first(dense_fn(q, k, v, softmax_scale=scale, causal=is_causal))

    def flash_dense_backward(grad_out, q, k, v, is_causal: bool, scale: float):
        # The package's public API returns no softmax statistics, so the backward runs its
        # forward again under autograd and differentiates that (one extra forward per step).
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = _first(dense_fn(*leaves, softmax_scale=scale, causal=is_causal))
            grads = torch.autograd.grad(out, leaves, grad_out)
        return tuple(g.contiguous() for g in grads)

    def flash_paged(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len: int,
        decode: bool,
        is_causal: bool,
        scale: float,
    ):
        # q [T, Hq, D]; caches [P, S, Hkv, D]; block_table int32 [B, W]; seq_lens int32 [B].
        # Both forms align the causal edge bottom-right against seqused_k: astr's convention.
        common = dict(
            seqused_k=seq_lens, page_table=block_table, softmax_scale=scale, causal=is_causal
        )
        if decode:
            batch = seq_lens.shape[0]
            out = _first(varlen_fn(q.reshape(batch, 1, *q.shape[1:]), k_cache, v_cache, **common))
            return out.reshape(q.shape[0], q.shape[1], -1)
        return _first(
            varlen_fn(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=query_start_loc,
                max_seqlen_q=max_query_len,
                **common,
            )
        )

    library = _new_library()
    for key in ("CPU", "CUDA"):  # CPU: only ever reached by a test double; the resolver
        library.impl("flash_dense", flash_dense, key)  # sends CPU calls elsewhere
        library.impl("flash_dense_backward", flash_dense_backward, key)
        library.impl("flash_paged", flash_paged, key)

    @torch.library.register_fake("astr::flash_dense", lib=library)
    def _(q, k, v, is_causal, scale):
        return q.new_empty(q.shape[:-1] + v.shape[-1:])

    @torch.library.register_fake("astr::flash_dense_backward", lib=library)
    def _(grad_out, q, k, v, is_causal, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    @torch.library.register_fake("astr::flash_paged", lib=library)
    def _(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        max_query_len,
        decode,
        is_causal,
        scale,
    ):
        return q.new_empty(q.shape[:-1] + v_cache.shape[-1:])

    def setup_context(ctx, inputs, output):
        q, k, v, is_causal, scale = inputs
        ctx.save_for_backward(q, k, v)
        ctx.is_causal, ctx.scale = is_causal, scale

    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.ops.astr.flash_dense_backward(
            grad_out.contiguous(), q, k, v, ctx.is_causal, ctx.scale
        )
        return dq, dk, dv, None, None

    torch.library.register_autograd(
        "astr::flash_dense", backward, setup_context=setup_context, lib=library
    )
