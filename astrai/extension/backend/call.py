"""Turning a Python-API call into one ``torch.ops.astr.attention`` call (plus the KV-cache
append), so that the C++ resolver makes every choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def paged_query_tokens(q):
    """The query of a call over a KV cache as tokens ``[T, q_heads, head_dim]``."""
    if q.dim() < 2:
        raise RuntimeError(
            f"q: expected [batch, q_len, q_heads, head_dim] for a call over kv_cache, got shape "
            f"{list(q.shape)}"
        )
    return q.reshape(-1, q.shape[-2], q.shape[-1])


@dataclass(frozen=True)
class Variants:
    """The attention variants of one call (csrc/kernels/paged_attention/params.h defines them)."""

    window_left: int = -1
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None  # float32 [Hq]
    return_lse: bool = False

    def op_args(self) -> dict:
        """astr::attention's keyword arguments for them (return_lse picks the op's overload)."""
        args = dict(window_left=self.window_left, softcap=self.softcap, sinks=self.sinks)
        if self.return_lse:
            args["return_lse"] = True
        return args


NO_VARIANTS = Variants()


def attention_op_args(q, kv_cache, attn_mask, is_causal, fwd, scale, layer_id=0):
    """Positional/keyword arguments of astr::attention for a paged call over ``kv_cache``
    (an FP8 cache's scales of layer ``layer_id`` included)."""
    step = kv_cache.step
    if step is None:
        raise RuntimeError("kv_cache: call begin_step(...) before attention")
    scales = getattr(kv_cache, "scales", None)
    k_scale, v_scale = scales(layer_id) if scales is not None else (None, None)
    return dict(
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        block_table=step.block_table,
        seq_lens=step.seq_lens,
        query_start_loc=step.query_start_loc,
        max_query_len=step.max_query_len,
        mode=fwd or "prefill",
        k_scale=k_scale,
        v_scale=v_scale,
    )


def run_builtin(
    q,
    k,
    v,
    kv_cache,
    layer_id,
    attn_mask,
    is_causal,
    fwd,
    selection: dict,
    scale: Optional[float] = None,
    variants: Variants = NO_VARIANTS,
):
    """Run a call through the C++ resolver; ``selection``: the op's ``backend`` and
    ``backend_source`` keyword arguments, empty to let it read the context stack and
    ASTR_BACKEND itself (see astr::attention's contract in csrc/README.md). Returns out, or
    (out, lse) when ``variants.return_lse``."""
    if kv_cache is None:
        return torch.ops.astr.attention(
            q,
            k,
            v,
            attn_mask,
            is_causal,
            scale,
            mode=fwd,
            **selection,
            **variants.op_args(),
        )
    k_pool, v_pool = kv_cache.layer(layer_id)
    q_tokens = paged_query_tokens(q)  # [T, Hq, D]; checked before anything is appended
    if k is not None:
        kv_cache.append(layer_id, k, v)
    result = torch.ops.astr.attention(
        q_tokens,
        None,
        None,
        k_cache=k_pool,
        v_cache=v_pool,
        **selection,
        **attention_op_args(q, kv_cache, attn_mask, is_causal, fwd, scale, layer_id),
        **variants.op_args(),
    )
    if variants.return_lse:
        out, lse = result
        return out.view(*q.shape[:-1], out.shape[-1]), lse.view(q.shape[:-1])
    return result.view(*q.shape[:-1], result.shape[-1])
