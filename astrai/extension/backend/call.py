"""Turning a Python-API call into one ``torch.ops.astr.attention`` call (plus the KV-cache
append), so that the C++ resolver makes every choice."""

from __future__ import annotations

import json
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


def op_arguments(
    q,
    k,
    v,
    kv_cache,
    layer_id,
    attn_mask,
    is_causal,
    fwd,
    scale: Optional[float],
    window_left: int,
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
    return_lse: bool,
    selection,
) -> dict:
    """The keyword arguments of ``torch.ops.astr.attention`` (``return_lse``: its ``.lse``
    overload) and of ``torch.ops.astr.explain`` for one Python-API call; ``selection`` is what
    the call observed (astrai.extension.selection.Selection). A call over ``kv_cache`` passes
    the step's metadata, layer ``layer_id``'s pools (and FP8 scales), and q as tokens; its k/v
    are appended by ``run_builtin``, not passed. Arguments at the schema's default are left out:
    each one passed costs the op's argument parsing time on every call."""
    if kv_cache is None:
        args = dict(q=q, k=k, v=v, **selection.op_args)
        if fwd is not None:
            args["mode"] = fwd
    else:
        k_pool, v_pool = kv_cache.layer(layer_id)
        step = kv_cache.step
        if step is None:
            raise RuntimeError("kv_cache: call begin_step(...) before attention")
        args = dict(
            q=paged_query_tokens(q),
            k_cache=k_pool,
            v_cache=v_pool,
            block_table=step.block_table,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            max_query_len=step.max_query_len,
            mode=fwd or "prefill",
            **selection.op_args,
        )
        scales = getattr(kv_cache, "scales", None)  # (a cache without FP8 pools may not have it)
        if scales is not None:
            k_scale, v_scale = scales(layer_id)
            if k_scale is not None or v_scale is not None:
                args["k_scale"], args["v_scale"] = k_scale, v_scale
    if attn_mask is not None:
        args["attn_mask"] = attn_mask
    if is_causal is not False:
        args["is_causal"] = is_causal
    if scale is not None:
        args["scale"] = scale
    if window_left != -1:
        args["window_left"] = window_left
    if softcap is not None:
        args["softcap"] = softcap
    if sinks is not None:
        args["sinks"] = sinks
    if return_lse:  # only .lse takes it (and explain)
        args["return_lse"] = True
    return args


def check_call(args: dict) -> None:
    """Raises what ``torch.ops.astr.attention(**args)`` would raise before running (a bad
    argument, or no backend able to run the call), without running or writing anything: a
    refused call must not have appended its k/v. Through ``torch.ops.astr.explain``, which runs
    the op's validation and resolution; a dedicated check op can replace it here."""
    decision = torch.ops.astr.explain(**args)
    if decision.startswith('{"backend": "'):  # a backend was chosen (read without parsing)
        return
    decision = json.loads(decision)
    if decision["backend"] is None:
        raise RuntimeError(decision["error"])


def run_builtin(
    q,
    k,
    v,
    kv_cache,
    layer_id,
    attn_mask,
    is_causal,
    fwd,
    scale: Optional[float],
    window_left: int,
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
    return_lse: bool,
    selection,
):
    """Runs a call on the built-in backends (the C++ resolver chooses, given ``selection``).
    Over a KV cache, new k/v are appended once the op's checks have passed, then q attends.
    Returns out, or (out, lse) when ``return_lse``."""
    args = op_arguments(
        q,
        k,
        v,
        kv_cache,
        layer_id,
        attn_mask,
        is_causal,
        fwd,
        scale,
        window_left,
        softcap,
        sinks,
        return_lse,
        selection,
    )
    if kv_cache is None:
        return torch.ops.astr.attention(**args)
    if k is not None:
        # While torch.compile traces, the trace itself runs these checks on fake tensors before
        # any graph runs (and explain's string result cannot be traced).
        if not torch.compiler.is_compiling():
            check_call(args)
        kv_cache.append(layer_id, k, v)
    result = torch.ops.astr.attention(**args)
    if return_lse:
        out, lse = result
        return out.view(*q.shape[:-1], out.shape[-1]), lse.view(q.shape[:-1])
    return result.view(*q.shape[:-1], result.shape[-1])
