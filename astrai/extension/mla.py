"""Latent attention (DeepSeek-family multi-head latent attention, MLA) over a paged latent cache:
``mla_attention`` and ``explain_mla``, the Python faces of ``torch.ops.astr.mla_attention`` and
``torch.ops.astr.explain_mla``, with the same arguments.

Each cached token holds one latent ``ckv`` (``Dc`` = 512 values) and one rotary key ``krope``
(``Dr`` = 64), shared by every head. A serving engine absorbs the key up-projection into the
query (``q_nope``) and the value up-projection into the output, so that attention runs over the
latent itself::

    score(t, j) = scale * (q_nope[t] . ckv[j] + q_rope[t] . krope[j])
    out[t]      = sum_j softmax_j(score(t, j)) * ckv[j]        # [T, H, Dc], q's dtype

over the positions j that token t sees: its sequence's cached and new tokens, causally (new token
i of a sequence of length L with n new tokens sits at position L - n + i and sees positions up to
its own), exactly as ``astr::attention``'s paged calls. ``block_table``, ``seq_lens``,
``query_start_loc``, ``max_query_len`` and ``mode`` are theirs (``PagedLatentCache.step`` builds
them). An FP8 latent pool (``float8_e4m3fn``) is read as ``stored.float() * ckv_scale``
(float32 ``[1]``); the rotary keys stay in the model's dtype.

The backend is chosen as for ``attention``: ``backend=``, an ``attn_backend(...)`` context,
``ASTR_BACKEND``, else cuda > torch_native (flash has no latent attention).
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend.attention import Decision
from .selection import BackendSpec, observe


def _op_arguments(positional: tuple, is_causal, backend, ckv_scale, return_lse) -> tuple:
    """(positional, keyword) arguments of the op for one call of ``mla_attention`` or
    ``explain_mla`` (which take the same parameters, the op's positional ones first, in its
    order; is_causal, backend, ckv_scale and return_lse follow as keywords:
    csrc/ops/mla_attention_args.h); the selection is what the call observed
    (``astrai.extension.selection``), handed over as the op's typed arguments. (Parameters named
    here, not gathered by ``locals()``, which dynamo cannot trace.)"""
    selection = observe(backend)
    if selection.python_backend is not None:
        raise ValueError(
            f"{type(selection.python_backend).__name__} is written in Python: mla_attention "
            "runs only on the built-in backends (cuda, torch_native)"
        )
    keywords = dict(selection.op_args)
    if not is_causal:
        keywords["is_causal"] = False
    if ckv_scale is not None:
        keywords["ckv_scale"] = ckv_scale
    if return_lse:
        keywords["return_lse"] = True
    return positional, keywords


def mla_attention(
    q_nope: torch.Tensor,  # [T, H, Dc]: the query times the absorbed key up-projection
    q_rope: torch.Tensor,  # [T, H, Dr]: the query's rotary part (rope applied)
    ckv_cache: torch.Tensor,  # [P, S, Dc]: q's dtype, or float8_e4m3fn with ckv_scale
    krope_cache: torch.Tensor,  # [P, S, Dr]: q's dtype
    block_table: torch.Tensor,  # int32 [B, W]
    seq_lens: torch.Tensor,  # int32 [B]: cached + new tokens (the new ones already appended)
    query_start_loc: torch.Tensor,  # int32 [B + 1]: prefix sums of the new tokens
    max_query_len: int,  # the most new tokens of any sequence (a host int)
    mode: str,  # "prefill" or "decode" (one new token per sequence)
    scale: float,  # the softmax scale (DeepSeek: qk_head_dim ** -0.5, times yarn's mscale^2)
    is_causal: bool = True,
    backend: BackendSpec = None,
    ckv_scale: Optional[torch.Tensor] = None,  # FP8 latent pool: float32 [1]
    return_lse: bool = False,
):
    """Latent attention over a paged latent cache (module docstring). Returns out ``[T, H, Dc]``
    in q's dtype, or ``(out, lse)`` with ``return_lse``: lse float32 ``[T, H]``, the natural log
    of each row's softmax denominator (-inf for a row that sees no position, whose out is 0)."""
    positional, keywords = _op_arguments(
        (q_nope, q_rope, ckv_cache, krope_cache, block_table, seq_lens, query_start_loc)
        + (max_query_len, mode, scale),
        is_causal,
        backend,
        ckv_scale,
        return_lse,
    )
    return torch.ops.astr.mla_attention(*positional, **keywords)


def explain_mla(
    q_nope,
    q_rope,
    ckv_cache,
    krope_cache,
    block_table,
    seq_lens,
    query_start_loc,
    max_query_len,
    mode,
    scale,
    is_causal: bool = True,
    backend: BackendSpec = None,
    ckv_scale=None,
    return_lse: bool = False,
) -> Decision:
    """The resolver's decision for an ``mla_attention`` call, without running it."""
    positional, keywords = _op_arguments(
        (q_nope, q_rope, ckv_cache, krope_cache, block_table, seq_lens, query_start_loc)
        + (max_query_len, mode, scale),
        is_causal,
        backend,
        ckv_scale,
        return_lse,
    )
    return Decision.from_json(torch.ops.astr.explain_mla(*positional, **keywords))
