"""flash-attn's three entry points with flash-attn's argument names and meanings, run by astrai's
op (``torch.ops.astr.attention``: the resolver picks cuda, flash or torch_native as for any call).

    from astrai.compat.flash_attn import flash_attn_func, flash_attn_varlen_func
    from astrai.compat.flash_attn import flash_attn_with_kvcache

The conventions are flash-attn 2's documented ones:

- layouts: q ``[batch, seqlen_q, nheads, headdim]``, k/v ``[batch, seqlen_k, nheads_k, headdim]``
  (varlen: tokens ``[total, nheads, headdim]`` with ``cu_seqlens``); a paged cache
  ``[num_blocks, page_block_size, nheads_k, headdim]`` with ``block_table`` int32
  ``[batch, max_blocks]``, which is astrai's pool layout;
- ``causal=True`` aligns the mask to the bottom right: with ``seqlen_q < seqlen_k`` query i sees
  keys ``j <= i + seqlen_k - seqlen_q``; a row that sees no key returns zeros;
- ``window_size=(left, right)``: query i sees keys in
  ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``, -1 unbounded; causal
  sets ``right`` to 0;
- ``softcap=c > 0``: each scaled score s becomes ``c * tanh(s / c)``; ``softmax_scale`` defaults
  to ``1 / sqrt(headdim)``;
- ``flash_attn_with_kvcache``: ``cache_seqlens`` are the tokens in the cache *before* this call;
  ``k``/``v`` (the new tokens) are written into ``k_cache``/``v_cache`` in place at
  ``cache_seqlens, cache_seqlens + 1, ...``, then q attends over ``cache_seqlens + seqlen_new``
  keys; ``return_softmax_lse=True`` also returns the natural-log LSE ``[batch, nheads, seqlen_q]``.

What astrai cannot honour raises ``NotImplementedError`` naming the argument (``dropout_p > 0``,
``alibi_slopes``, ``rotary_cos``/``rotary_sin``, ``cache_leftpad``, ``return_attn_probs``, a
deterministic backward on CUDA); README.md ("Switching from flash-attn / FlashInfer") lists every
difference, e.g. the LSE of a row that sees no key: -inf here, +inf in flash-attn 2.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from ..extension.backend.call import check_call, run_op
from ..extension.ops import append_kv
from ..extension.selection import observe

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

# The cuda kernels take pages of up to this many slots (a power of two): a contiguous cache is
# viewed as pages of the largest such size dividing its length.
_MAX_PAGE_SIZE = 256


def _refuse(name: str, why: str) -> None:
    raise NotImplementedError(f"{name}: {why} (astrai.compat.flash_attn)")


def _check_common(dropout_p, alibi_slopes, deterministic, tensors) -> None:
    if dropout_p:
        _refuse(f"dropout_p={dropout_p}", "astrai has no attention dropout; pass 0.0")
    if alibi_slopes is not None:
        _refuse("alibi_slopes", "astrai has no ALiBi bias")
    if deterministic and torch.is_grad_enabled():
        needs_grad = any(t is not None and t.requires_grad for t in tensors)
        if needs_grad and tensors[0].is_cuda:
            _refuse(
                "deterministic=True",
                "the backward on CUDA (torch's SDPA or the flash-attn package) is not promised "
                "to be deterministic; the forward always is",
            )


def _window(causal: bool, window_size: Sequence[int]) -> Tuple[int, int]:
    """(left, right) as flash-attn applies them: -1 unbounded, and right 0 under causal."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size: expected (left, right) integers, got {window_size!r}"
        ) from None
    left = -1 if left < 0 else left
    right = -1 if right < 0 else right
    return left, (0 if causal else right)


def _softcap(softcap: float) -> Optional[float]:
    return float(softcap) if softcap and softcap > 0 else None  # flash-attn: "> 0 activates"


def _keys_visible(rows_at: torch.Tensor, keys: torch.Tensor, left: int, right: int):
    """Whether a query at kv position ``rows_at`` (broadcast against ``keys``) sees each key:
    ``rows_at - left <= key <= rows_at + right``, a bound of -1 unbounded."""
    visible = torch.ones(
        torch.broadcast_shapes(rows_at.shape, keys.shape), dtype=torch.bool, device=keys.device
    )
    if left >= 0:
        visible &= keys >= rows_at - left
    if right >= 0:
        visible &= keys <= rows_at + right
    return visible


def _selection_args() -> dict:
    selection = observe()
    if selection.python_backend is not None:
        raise NotImplementedError(
            f"{type(selection.python_backend).__name__} is written in Python: "
            "astrai.compat.flash_attn runs only on the built-in backends"
        )
    return dict(selection.op_args)


def _options(softmax_scale, softcap) -> dict:
    options = {}
    if softmax_scale is not None:
        options["scale"] = float(softmax_scale)
    capped = _softcap(softcap)
    if capped is not None:
        options["softcap"] = capped
    return options


def _refuse_attn_probs(return_attn_probs: bool) -> None:
    if return_attn_probs:
        _refuse(
            "return_attn_probs=True",
            "astrai never materialises attention probabilities; for the log-sum-exp pass "
            "return_softmax_lse=True",
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
    *,
    return_softmax_lse=False,
):
    """flash-attn's ``flash_attn_func``: q ``[B, Lq, H, D]``, k/v ``[B, Lk, Hk, D]`` (GQA when
    ``Hk`` divides ``H``), differentiable. ``causal`` is bottom-right aligned and
    ``window_size=(left, right)`` follows flash-attn (module docstring). Returns out
    ``[B, Lq, H, D]``, or ``(out, lse)`` with ``return_softmax_lse=True`` (astrai's keyword,
    named as in ``flash_attn_with_kvcache``: lse float32 ``[B, H, Lq]``, natural log)."""
    _check_common(dropout_p, alibi_slopes, deterministic, (q, k, v))
    _refuse_attn_probs(return_attn_probs)
    left, right = _window(causal, window_size)
    q_len, kv_len = q.shape[1], k.shape[1]
    args = dict(q=q, k=k, v=v, **_selection_args(), **_options(softmax_scale, softcap))
    if right == 0 and q_len == kv_len:  # top-left and bottom-right coincide: the op's own rule
        args["is_causal"] = True
        if left >= 0:
            args["window_left"] = left
    elif (left, right) != (-1, -1):  # query i sits at kv position i + kv_len - q_len
        rows_at = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        keys = torch.arange(kv_len, device=q.device)[None, :]
        args["attn_mask"] = _keys_visible(rows_at, keys, left, right)  # [Lq, Lk]
    if not return_softmax_lse:
        return run_op(args)
    out, lse = run_op(dict(args, return_lse=True))
    return out, lse.transpose(1, 2)  # [B, Lq, H] -> [B, H, Lq]


def _paged_call(
    q_tokens,
    k_pool,
    v_pool,
    block_table,
    seq_lens,
    query_start_loc,
    max_query_len: int,
    max_kv_len: int,
    left: int,
    right: int,
    softmax_scale,
    softcap,
    decode: bool = False,
) -> dict:
    """The op's arguments for a paged call of flash-attn's meaning. The op places new token i of
    a sequence at ``seq_len - q_len + i``, flash-attn's bottom-right alignment; a window other
    than (left, 0) becomes a bool mask ``[T, max_kv_len]`` over each sequence's positions."""
    args = dict(
        q=q_tokens,
        k_cache=k_pool,
        v_cache=v_pool,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=max(int(max_query_len), 1),
        mode="decode" if decode else "prefill",
        **_selection_args(),
        **_options(softmax_scale, softcap),
    )
    if right == 0:
        args["is_causal"] = True
        if left >= 0:
            args["window_left"] = left
    elif (left, right) != (-1, -1):
        tokens = q_tokens.shape[0]
        token = torch.arange(tokens, device=q_tokens.device)
        seq = torch.searchsorted(query_start_loc[1:].long(), token, right=True)
        q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
        rows_at = seq_lens.long()[seq] - q_lens[seq] + (token - query_start_loc.long()[seq])
        keys = torch.arange(max(int(max_kv_len), 1), device=q_tokens.device)[None, :]
        args["attn_mask"] = _keys_visible(rows_at[:, None], keys, left, right)
    return args


def _run_paged(args: dict, return_lse: bool):
    if return_lse:
        return run_op(dict(args, return_lse=True))
    return run_op(args), None


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    return_softmax_lse=False,
):
    """flash-attn's ``flash_attn_varlen_func``: the sequences packed as tokens, q
    ``[total_q, H, D]`` and k/v ``[total_k, Hk, D]`` delimited by ``cu_seqlens_q`` /
    ``cu_seqlens_k`` (int32 ``[batch + 1]``); with ``block_table`` k/v are a paged cache
    ``[num_blocks, page_block_size, Hk, D]`` and ``cu_seqlens_k`` gives each sequence's kv
    length. Causal and windows are per sequence, bottom-right aligned. Returns out
    ``[total_q, H, D]``, or ``(out, lse)`` with ``return_softmax_lse=True`` (astrai's keyword:
    lse float32 ``[H, total_q]``, natural log, flash-attn's layout)."""
    _check_common(dropout_p, alibi_slopes, deterministic, (q, k, v))
    _refuse_attn_probs(return_attn_probs)
    left, right = _window(causal, window_size)
    seq_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    if block_table is None:
        # Each key token its own page of one slot; sequence b's pages are its tokens in order.
        k_pool, v_pool = k.unsqueeze(1), v.unsqueeze(1)
        width = max(int(max_seqlen_k), 1)
        position = torch.arange(width, device=k.device, dtype=torch.int32)
        block_table = cu_seqlens_k[:-1, None].to(torch.int32) + position[None, :]
        block_table = block_table.clamp(max=max(k.shape[0] - 1, 0))
    else:
        k_pool, v_pool = k, v
    args = _paged_call(
        q,
        k_pool,
        v_pool,
        block_table.to(torch.int32),
        seq_lens,
        cu_seqlens_q.to(torch.int32),
        max_seqlen_q,
        max_seqlen_k,
        left,
        right,
        softmax_scale,
        softcap,
    )
    out, lse = _run_paged(args, return_softmax_lse)
    return (out, lse.transpose(0, 1)) if return_softmax_lse else out  # [T, H] -> [H, T]


def _pages_of_contiguous_cache(cache: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """A cache ``[batch_cache, seqlen_cache, Hk, D]`` as a pool of pages (a view, so that appends
    write the caller's tensor): the largest power-of-two page size up to 256 that divides
    seqlen_cache and that the strides allow, else one page per sequence."""
    batch_cache, seqlen_cache = cache.shape[0], cache.shape[1]
    page_size = min(seqlen_cache & -seqlen_cache, _MAX_PAGE_SIZE) if seqlen_cache else 1
    try:
        pool = cache.view(batch_cache * (seqlen_cache // page_size), page_size, *cache.shape[2:])
        return pool, page_size
    except RuntimeError:  # a batch stride the split cannot express
        return cache, seqlen_cache


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """flash-attn's ``flash_attn_with_kvcache``: q ``[B, Lq, H, D]`` over a cache that is
    contiguous, ``[batch_cache, seqlen_cache, Hk, D]`` (rows chosen by ``cache_batch_idx``, else
    0..B-1), or paged, ``[num_blocks, page_block_size, Hk, D]`` with ``block_table``.
    ``cache_seqlens`` (int or int32 ``[B]``) counts the tokens cached *before* this call; new
    ``k``/``v`` ``[B, L_new, Hk, D]`` are written in place after them, then q attends over
    ``cache_seqlens + L_new`` keys (causal: bottom-right). The cache must have room: a write past
    it raises where the lengths can be read without a synchronisation (CPU tensors, or the
    checked mode: ``ASTR_CHECK_METADATA``), and is skipped otherwise (the positions past the cache
    are then not attended either). A call that is refused writes nothing. ``num_splits`` is a
    hint astrai's plan does not need (results do not depend on it); ``rotary_interleaved`` means
    nothing without rotary. Returns out ``[B, Lq, H, D]``, or ``(out, lse)`` with
    ``return_softmax_lse=True`` (lse float32 ``[B, H, Lq]``, natural log)."""
    _check_common(0.0, alibi_slopes, False, (q,))
    if rotary_cos is not None or rotary_sin is not None:
        _refuse("rotary_cos/rotary_sin", "apply the rotary embedding to q and k before the call")
    if cache_leftpad is not None:
        _refuse("cache_leftpad", "astrai's caches start at position 0")
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both (the new tokens to append) or neither")
    batch, q_len = q.shape[0], q.shape[1]
    device = q.device
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not with block_table (the table picks the pages)")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: required with block_table")
        k_pool, v_pool, page_size = k_cache, v_cache, k_cache.shape[1]
        block_table = block_table.to(torch.int32)
    else:
        k_pool, page_size = _pages_of_contiguous_cache(k_cache)
        v_pool, v_page_size = _pages_of_contiguous_cache(v_cache)
        if v_page_size != page_size:
            k_pool, v_pool, page_size = k_cache, v_cache, k_cache.shape[1]
        rows = (
            torch.arange(batch, device=device)
            if cache_batch_idx is None
            else cache_batch_idx.to(device=device, dtype=torch.long)
        )
        pages_per_seq = k_cache.shape[1] // page_size
        page = torch.arange(pages_per_seq, device=device)
        block_table = (rows[:, None] * pages_per_seq + page[None, :]).to(torch.int32)
        if cache_seqlens is None:
            if k is not None:
                raise ValueError("cache_seqlens: required when k/v are appended")
            cache_seqlens = k_cache.shape[1]  # attend over the whole cache
    capacity = block_table.shape[1] * page_size
    if isinstance(cache_seqlens, int):
        cached = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    else:
        cached = cache_seqlens.to(device=device, dtype=torch.int32)
    new_len = 0 if k is None else k.shape[1]
    seq_lens = cached + new_len
    query_start_loc = torch.arange(0, (batch + 1) * q_len, q_len, device=device, dtype=torch.int32)
    left, right = _window(causal, window_size)
    args = _paged_call(
        q.reshape(batch * q_len, q.shape[2], q.shape[3]),
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        query_start_loc,
        q_len,
        capacity,
        left,
        right,
        softmax_scale,
        softcap,
        decode=q_len == 1,
    )
    if k is not None:
        slots = _append_slots(cached, new_len, block_table, page_size, capacity)
        check_call(args)  # everything the op would refuse, before anything is written
        append_kv(
            k.reshape(batch * new_len, *k.shape[2:]),
            v.reshape(batch * new_len, *v.shape[2:]),
            k_pool,
            v_pool,
            slots,
        )
    out, lse = _run_paged(args, return_softmax_lse)
    out = out.view(batch, q_len, *out.shape[1:])
    if not return_softmax_lse:
        return out
    return out, lse.view(batch, q_len, -1).transpose(1, 2)  # [B, H, Lq]


def _append_slots(cached, new_len: int, block_table, page_size: int, capacity: int):
    """int32 ``[B * new_len]``: the pool slot of new token j of sequence b, at position
    ``cached[b] + j``. A position past the cache raises where reading the lengths costs no
    synchronisation, else its slot is -1 (``append_kv`` skips it)."""
    position = cached.long()[:, None] + torch.arange(new_len, device=cached.device)[None, :]
    past = position >= capacity
    if cached.device.type == "cpu" or torch.ops.astr.metadata_checks():
        if bool(past.any()):
            raise ValueError(
                f"k, v: cache_seqlens + {new_len} new tokens pass the cache's {capacity} "
                "positions for some sequence (the cache must have room for the new tokens)"
            )
    inside = position.clamp(max=capacity - 1)
    page = torch.gather(block_table.long(), 1, inside // page_size)
    slots = page * page_size + inside % page_size
    return torch.where(past, -1, slots).to(torch.int32).reshape(-1)
