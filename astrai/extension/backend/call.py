"""Turning a Python-API call into one ``torch.ops.astr.attention`` call (plus the KV-cache
append), so that the C++ resolver makes every choice."""

from __future__ import annotations

import json

import torch

from .. import ops, visibility

_visible = visibility.enabled
_attention_op = torch.ops.astr.attention


def paged_query_tokens(q):
    """The query of a call over a KV cache as tokens ``[T, q_heads, head_dim]``."""
    if q.dim() < 2:
        raise RuntimeError(
            f"q: expected [batch, q_len, q_heads, head_dim] for a call over kv_cache, got shape "
            f"{list(q.shape)}"
        )
    return q.reshape(-1, q.shape[-2], q.shape[-1])


# The attention op's arguments that have defaults, and those defaults, from its schema (the one
# list: csrc/ops/attention_args.h); return_lse, which only the .lse overload takes, is off.
_OP_DEFAULTS = {
    argument.name: argument.default_value
    for argument in torch.ops.astr.attention.default._schema.arguments
    if argument.has_default_value()
}
_OP_DEFAULTS["return_lse"] = False


def _at_default(name: str, value) -> bool:
    default = _OP_DEFAULTS[name]
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def op_arguments(q, k, v, kv_cache, layer_id, fwd, selection, options: dict) -> dict:
    """The keyword arguments of ``torch.ops.astr.attention`` (``return_lse``: its ``.lse``
    overload) and of ``torch.ops.astr.explain`` for one Python-API call. ``selection`` is what
    the call observed (astrai.extension.selection.Selection); ``options`` the call's other op
    arguments by name (mask, causality, scale, the variants, return_lse). A call over
    ``kv_cache`` passes the step's metadata, layer ``layer_id``'s pools (and FP8 scales), and q
    as tokens; its k/v are appended by ``run_builtin``, not passed. Arguments at the schema's
    default are left out: each one passed costs the op's argument parsing on every call."""
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
    for name, value in options.items():
        if not _at_default(name, value):
            args[name] = value
    return args


def options_off_default(options: dict) -> list:
    """The names of ``options`` not at the op's defaults."""
    return [name for name, value in options.items() if not _at_default(name, value)]


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


def run_op(args: dict):
    """``torch.ops.astr.attention(**args)``: every call of the Python API goes through here, so
    that the ``astrai`` logger and profiler ranges see it (astrai.extension.visibility; off
    unless asked for)."""
    if _visible():
        return visibility.run_visibly(_attention_op, args)
    return _attention_op(**args)


def _observe_batch_invariance() -> bool:
    """Batch-invariant mode as the Python side holds it (ops.batch_invariant_enabled). Branched
    on, so that torch.compile guards on it (a value it only loads, it does not): a graph traced in
    one mode recompiles in the other, since the torch_native backend decomposes at trace time."""
    return True if ops.batch_invariant_enabled else False


def run_builtin(q, k, v, kv_cache, layer_id, fwd, selection, options: dict):
    """Runs a call on the built-in backends (the C++ resolver chooses, given ``selection``;
    ``options``: as for ``op_arguments``). Over a KV cache, new k/v are appended once the op's
    checks have passed, then q attends. Returns out, or (out, lse) with ``return_lse``."""
    args = op_arguments(q, k, v, kv_cache, layer_id, fwd, selection, options)
    if kv_cache is None:
        return run_op(args)
    _observe_batch_invariance()
    if (k is None) != (v is None):
        missing, given = ("k", "v") if k is None else ("v", "k")
        raise TypeError(
            f"{missing}: expected a tensor, got None while {given} is given (a call over "
            "kv_cache appends both new k and v, or neither: both None attend over the cache)"
        )
    if k is not None:
        # While torch.compile traces, the trace itself runs these checks on fake tensors before
        # any graph runs (and explain's string result cannot be traced).
        if not torch.compiler.is_compiling():
            check_call(args)
        kv_cache.append(layer_id, k, v)
    result = run_op(args)
    if args.get("return_lse", False):
        out, lse = result
        return out.view(*q.shape[:-1], out.shape[-1]), lse.view(q.shape[:-1])
    return result.view(*q.shape[:-1], result.shape[-1])
