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

import functools
import inspect
from types import ModuleType
from typing import Optional

import torch

_LIBRARY: Optional[torch.library.Library] = None


def _first(result):
    return result[0] if isinstance(result, (tuple, list)) else result


def _no_lse(out):
    """The empty lse the ops return when the call did not ask for one."""
    return out.new_empty(0, dtype=torch.float32)


def _lse_like(lse, rows):
    """The package's log-sum-exp ([B, H, L] dense, [H, T] or [B, H, 1] paged) as astrai's:
    out's shape without its last dim (``rows``: [B, L, H] or [T, H]), float32."""
    if lse is None:
        raise RuntimeError("flash backend: the installed flash-attn returned no log-sum-exp")
    lse = lse.float()
    if tuple(lse.shape) == tuple(rows):
        return lse
    if lse.dim() == 3 and len(rows) == 3:  # [B, H, L] -> [B, L, H]
        return lse.transpose(1, 2).contiguous()
    if lse.dim() == 2 and len(rows) == 2:  # [H, T] -> [T, H]
        return lse.transpose(0, 1).contiguous()
    if lse.dim() == 3 and len(rows) == 2:  # decode [B, H, 1] -> [B, H]
        return lse.reshape(rows[0], -1).contiguous()
    raise RuntimeError(
        f"flash backend: cannot read the package's log-sum-exp of shape {tuple(lse.shape)} "
        f"as {tuple(rows)}"
    )


@functools.cache
def _parameters(function) -> tuple:
    """(the names a package function takes, whether it takes **kwargs): read once per function,
    since inspect.signature costs tens of microseconds and the ops below run on every call."""
    parameters = inspect.signature(function).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return frozenset(parameters), accepts_any


def _variant_kwargs(function, window_left, softcap, no_window):
    """The package's own arguments for a window and a softcap: window_size=(left, 0) (the right
    side 0: causal) and softcap=c. Plain calls pass neither, so packages without them work."""
    kwargs = {}
    parameters, accepts_any = _parameters(function)
    if window_left >= 0:
        if "window_size" not in parameters and not accepts_any:
            raise RuntimeError(f"flash backend: {function.__module__} has no window_size")
        kwargs["window_size"] = (window_left, 0)
    elif "window_size" in parameters:
        kwargs["window_size"] = no_window
    if softcap > 0:
        if "softcap" not in parameters and not accepts_any:
            raise RuntimeError(f"flash backend: {function.__module__} has no softcap")
        kwargs["softcap"] = softcap
    return kwargs


def _paged_kwarg(function) -> str:
    """FlashAttention-2 names the page table ``block_table``; FlashAttention-3 ``page_table``."""
    return "block_table" if "block_table" in _parameters(function)[0] else "page_table"


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

    def flash_dense(
        q,
        k,
        v,
        is_causal: bool,
        scale: float,
        window_left: int = -1,
        softcap: float = 0.0,
        return_lse: bool = False,
    ):
        # q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D] -> [B, Lq, Hq, D], lse [B, Lq, Hq]
        kwargs = _variant_kwargs(dense_fn, window_left, softcap, (-1, -1))
        if return_lse:
            kwargs["return_attn_probs"] = True  # FlashAttention-2/3: (out, lse, ...)
        result = dense_fn(q, k, v, softmax_scale=scale, causal=is_causal, **kwargs)
        out = _first(result)
        if not return_lse:
            return out, _no_lse(out)
        return out, _lse_like(result[1], out.shape[:-1])

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
        window_left: int = -1,
        softcap: float = 0.0,
        return_lse: bool = False,
    ):
        # q [T, Hq, D]; caches [P, S, Hkv, D]; block_table int32 [B, W]; seq_lens int32 [B]
        if kvcache_fn is None:
            raise RuntimeError(f"flash backend: {module.__name__} has no flash_attn_with_kvcache")
        batch = seq_lens.shape[0]
        if decode:
            padded, seq, pos = q.view(batch, 1, q.shape[1], q.shape[2]), None, None
        else:
            padded, seq, pos = _left_padded(q, query_start_loc, max_query_len, batch)
        kwargs = _variant_kwargs(kvcache_fn, window_left, softcap, (-1, -1))
        if return_lse:
            kwargs["return_softmax_lse"] = True
        result = kvcache_fn(
            padded,
            k_cache,
            v_cache,
            cache_seqlens=seq_lens,
            softmax_scale=scale,
            causal=is_causal,
            **{_paged_kwarg(kvcache_fn): block_table},
            **kwargs,
        )
        out = _first(result)
        out = out.view(q.shape[0], q.shape[1], -1) if decode else out[seq, pos]
        if not return_lse:
            return out, _no_lse(out)
        lse = _lse_like(result[1], padded.shape[:-1])  # [B, max_q, Hq]
        lse = lse.view(q.shape[0], q.shape[1]) if decode else lse[seq, pos]
        return out, lse

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
    no_window = (None, None)

    def flash_dense(
        q,
        k,
        v,
        is_causal: bool,
        scale: float,
        window_left: int = -1,
        softcap: float = 0.0,
        return_lse: bool = False,
    ):
        # FlashAttention-4 returns (out, lse), lse [B, H, L].
        kwargs = _variant_kwargs(dense_fn, window_left, softcap, no_window)
        result = dense_fn(q, k, v, softmax_scale=scale, causal=is_causal, **kwargs)
        out = _first(result)
        if not return_lse:
            return out, _no_lse(out)
        return out, _lse_like(result[1], out.shape[:-1])

    def flash_dense_backward(
        grad_out,
        q,
        k,
        v,
        is_causal: bool,
        scale: float,
        window_left: int = -1,
        softcap: float = 0.0,
    ):
        # The package's public API returns no softmax statistics, so the backward runs its
        # forward again under autograd and differentiates that (one extra forward per step).
        kwargs = _variant_kwargs(dense_fn, window_left, softcap, no_window)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = _first(dense_fn(*leaves, softmax_scale=scale, causal=is_causal, **kwargs))
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
        window_left: int = -1,
        softcap: float = 0.0,
        return_lse: bool = False,
    ):
        # q [T, Hq, D]; caches [P, S, Hkv, D]; block_table int32 [B, W]; seq_lens int32 [B].
        # Both forms align the causal edge bottom-right against seqused_k: astr's convention.
        common = dict(
            seqused_k=seq_lens,
            page_table=block_table,
            softmax_scale=scale,
            causal=is_causal,
            **_variant_kwargs(varlen_fn, window_left, softcap, no_window),
        )
        if decode:
            batch = seq_lens.shape[0]
            result = varlen_fn(q.reshape(batch, 1, *q.shape[1:]), k_cache, v_cache, **common)
            out = _first(result).reshape(q.shape[0], q.shape[1], -1)
        else:
            result = varlen_fn(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=query_start_loc,
                max_seqlen_q=max_query_len,
                **common,
            )
            out = _first(result)
        if not return_lse:
            return out, _no_lse(out)
        return out, _lse_like(result[1], out.shape[:-1])

    library = _new_library()
    for key in ("CPU", "CUDA"):  # CPU: only ever reached by a test double; the resolver
        library.impl("flash_dense", flash_dense, key)  # sends CPU calls elsewhere
        library.impl("flash_dense_backward", flash_dense_backward, key)
        library.impl("flash_paged", flash_paged, key)

    def lse_fake(q, return_lse):
        return q.new_empty(q.shape[:-1] if return_lse else (0,), dtype=torch.float32)

    @torch.library.register_fake("astr::flash_dense", lib=library)
    def _(q, k, v, is_causal, scale, window_left=-1, softcap=0.0, return_lse=False):
        return q.new_empty(q.shape[:-1] + v.shape[-1:]), lse_fake(q, return_lse)

    @torch.library.register_fake("astr::flash_dense_backward", lib=library)
    def _(grad_out, q, k, v, is_causal, scale, window_left=-1, softcap=0.0):
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
        window_left=-1,
        softcap=0.0,
        return_lse=False,
    ):
        return q.new_empty(q.shape[:-1] + v_cache.shape[-1:]), lse_fake(q, return_lse)

    def setup_context(ctx, inputs, output):
        q, k, v, is_causal, scale, *variant = inputs
        window_left, softcap = (list(variant) + [-1, 0.0])[:2]
        ctx.save_for_backward(q, k, v)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.window_left, ctx.softcap = window_left, softcap

    def backward(ctx, grad_out, grad_lse):
        # grad_lse: the log-sum-exp output is not differentiated through on this path.
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.ops.astr.flash_dense_backward(
            grad_out.contiguous(), q, k, v, ctx.is_causal, ctx.scale, ctx.window_left, ctx.softcap
        )
        return dq, dk, dv, None, None, None, None, None

    torch.library.register_autograd(
        "astr::flash_dense", backward, setup_context=setup_context, lib=library
    )
