"""Hugging Face transformers runs its models' attention through astrai.

    from astrai.integrations import transformers as astrai_transformers
    astrai_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="astrai")

``"astrai"``: every attention call of the model goes through ``astrai.extension.attention``:
training, ``generate`` with transformers' own cache, padded batches (transformers' boolean mask,
True = attend) and GQA with the kv heads as they are. The module's scaling, sliding window,
logit softcap, attention sinks and sparse top-k indices (DeepSeek V3.2, GLM-5) are passed on,
and an ``attn_backend(...)`` context of the calling thread applies inside the model. Every other
keyword a model passes is either consumed, refused where set, or listed as carrying no meaning
for attention (``CONSUMED_KWARGS``, ``REFUSED_KWARGS``, ``NO_MEANING_FOR_ATTENTION``); an
unknown one raises ``NotImplementedError`` naming it.

``"paged|astrai"`` (transformers' continuous batching: ``generate_batch`` and the continuous
batching manager; from transformers 5.19 on the manager keeps the name ``"astrai"``): the new
tokens' keys and values are written into transformers' own paged cache with
``torch.ops.astr.append_kv`` and the queries attend over that cache in place, through astrai's
paged op (our CUDA kernels on a GPU, torch_native elsewhere). The step's block table, lengths and
slots are computed on the device from transformers' read/write indices and cumulative lengths,
once per step, so the decode step copies no cache and reads nothing back to the host.
Sliding-window layer groups keep their tokens in transformers' rolling buffer, which a block
table cannot describe: those layers attend over the window that transformers gathers from it,
through the same paged op (one token per page).

Tested with transformers 5.17 to 5.25 (``TESTED_TRANSFORMERS``); the continuous-batching hooks
depend on transformers internals that change between minor releases.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from astrai.extension import StepMetadata, attention, attn_backend
from astrai.extension.selection import task_backends

try:
    import transformers
    from packaging.version import Version
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "astrai.integrations.transformers needs the transformers package "
        "(pip install 'transformers>=5.17,<5.26')"
    ) from error

NAME = "astrai"
PAGED_NAME = "paged|astrai"
TESTED_TRANSFORMERS = (">=5.17", "<5.26")
_NAMES = (NAME, PAGED_NAME)
# transformers' own paged attention, to compare with: "paged|sdpa" up to 5.18, "sdpa" after.
TRANSFORMERS_PAGED = "paged|sdpa" if Version(transformers.__version__) < Version("5.19") else "sdpa"
# Keys the cache update leaves in a continuous-batching call's kwargs for the attention: a
# full-attention layer's pools, a rolling-buffer layer's gathered window (5.17, 5.18), and that
# the update ran (our hook, 5.19 on).
_PAGED_LAYER_KEY = "astrai_paged_layer"
_GATHERED_KEY = "astrai_gathered_window"
_UPDATED_KEY = "astrai_cache_updated"

_ATTENTION_PARAMETERS = inspect.signature(attention).parameters

# -- what astrai does with each keyword argument ---------------------------------------------
# transformers' models call their attention function with keyword arguments of their own and
# with the **kwargs that flow down from the model's forward (TransformersKwargs,
# FlashAttentionKwargs, continuous batching's PagedAttentionArgs). Each is consumed (its meaning
# goes into astrai's call), refused where set (NotImplementedError naming it), or carries no
# meaning for attention; any other keyword raises, so that a new transformers release cannot
# bring an argument that astrai would silently ignore. The test
# tests/integrations/test_transformers_kwargs.py walks every model of the installed
# transformers against these lists.
CONSUMED_KWARGS = frozenset(
    {
        "dropout",  # > 0 raises: astrai has no dropout
        "scaling",
        "is_causal",
        "sliding_window",
        "softcap",
        "s_aux",  # attention sinks, one logit per q head (gpt-oss, DeepSeek V4)
        "sinks",  # the same, where a model names them so; per-token sinks raise
        "indices",  # DeepSeek sparse attention's top-k key positions -> topk_indices
        "output_attentions",  # True raises: astrai returns no attention weights
        "cu_seq_lens_q",  # packed sequences (dense), the step's query tokens (continuous batching)
        "cu_seq_lens_k",
        "max_length_q",  # bounds of the above
        "max_length_k",
        "max_seqlen_q",  # their names up to transformers 5.18
        "max_seqlen_k",
        # continuous batching: the cache and where this step reads and writes it
        "cache",
        "read_index",
        "write_index",
        "block_table",  # transformers' own block table (flash's fused path); astrai builds its own
        _PAGED_LAYER_KEY,
        _GATHERED_KEY,
        _UPDATED_KEY,
    }
)
# Refused when set (None, or False for a flag, is fine): what each asks for, which astrai lacks.
REFUSED_KWARGS = {
    "position_bias": "an additive per-head score bias (T5-style relative positions)",
    "block_indices": "block-sparse key selection per kv head (MiniMax M3)",
    "deterministic": "a deterministic backward, which astrai's backends do not promise",
}
# Keywords that reach an attention function but carry no meaning for attention, and why.
NO_MEANING_FOR_ATTENTION = {
    "position_ids": "positions are already in q and k (the rotary embedding), and packed "
    "sequences found from them are in transformers' mask",
    "use_cache": "whether the model keeps a cache; this layer's cache was updated before",
    "output_router_logits": "asks the MoE routers for their logits",
    "output_hidden_states": "asks the model for its hidden states",
    "num_items_in_batch": "normalises the loss over gradient accumulation",
    "seq_idx": "packed sequences' index for state-space (Mamba) layers; attention reads "
    "packing from the mask or cu_seq_lens_q/k",
    "logits_indices": "which rows continuous batching samples from, after the model",
    "logits_processor_args": "continuous batching's sampling arguments, after the model",
}


def _check_kwargs(kwargs: Dict[str, Any]) -> None:
    """Raise for a keyword astrai cannot honour: one refused and set, or one it does not know."""
    for name, value in kwargs.items():
        if name in CONSUMED_KWARGS or name in NO_MEANING_FOR_ATTENTION:
            continue
        if name in REFUSED_KWARGS:
            if value is None or value is False:
                continue
            raise NotImplementedError(
                f"{name}: {REFUSED_KWARGS[name]} is not supported by the astrai attention; use "
                "another attn_implementation for this model"
            )
        raise NotImplementedError(
            f"{name}: transformers passed this keyword to the attention function, and astrai's "
            "integration does not know it (it would be silently ignored); "
            "astrai.integrations.transformers lists the keywords it consumes, refuses and "
            "ignores"
        )


def _variant_arguments(
    window_left: int = -1,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    topk_indices: Optional[torch.Tensor] = None,
) -> Dict[str, Any]:
    """The attention-variant arguments for astrai's ``attention``, raising a clear error when
    this astrai's ``attention`` does not take one that the model needs."""
    wanted = {}
    if window_left >= 0:
        wanted["window_left"] = (window_left, "a sliding window")
    if softcap is not None and softcap > 0:
        wanted["softcap"] = (float(softcap), "attention logit softcapping")
    if sinks is not None:
        wanted["sinks"] = (sinks.float(), "attention sinks")
    if topk_indices is not None:
        wanted["topk_indices"] = (topk_indices, "sparse top-k attention (indices)")
    arguments = {}
    for name, (value, what) in wanted.items():
        if name not in _ATTENTION_PARAMETERS:
            raise NotImplementedError(
                f"this model uses {what}, but astrai.extension.attention has no `{name}` "
                f"argument in this build of astrai; update astrai"
            )
        arguments[name] = value
    return arguments


def _layer_window(module: torch.nn.Module, sliding_window: Optional[int]) -> Optional[int]:
    """transformers' window of a layer: each query sees this many keys, itself included."""
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is None or sliding_window is False or sliding_window <= 0:
        return None
    return int(sliding_window)


def _kwarg(kwargs: Dict[str, Any], *names: str):
    """The first of ``names`` present in kwargs (transformers renamed some CB arguments)."""
    for name in names:
        if name in kwargs:
            return kwargs[name]
    raise KeyError(f"continuous batching call without any of {names}")


def _for_layer_type(value, layer_type: str):
    return value[layer_type] if isinstance(value, dict) else value


# -- dense ---------------------------------------------------------------------------------


def _sinks(s_aux: Optional[torch.Tensor], sinks: Optional[torch.Tensor], q_heads: int):
    """One sink logit per q head (``s_aux`` or ``sinks``), or None; per-token sinks raise."""
    if s_aux is not None and sinks is not None:
        raise NotImplementedError("s_aux, sinks: a model passed both; astrai takes one")
    found = s_aux if s_aux is not None else sinks
    if found is None:
        return None
    if found.dim() != 1 or found.shape[0] != q_heads:
        name = "s_aux" if s_aux is not None else "sinks"
        raise NotImplementedError(
            f"{name}: astrai takes one sink logit per query head ([{q_heads}]), got shape "
            f"{list(found.shape)} (per-token sinks are not supported)"
        )
    return found


def _packed_sequences_mask(cu_seq_lens_q, cu_seq_lens_k, q_len: int, kv_len: int):
    """bool ``[1, 1, Lq, Lk]``: a query sees only the keys of its own packed sequence (flash's
    varlen description of one row holding several sequences)."""
    cu_q, cu_k = cu_seq_lens_q.to(torch.long), cu_seq_lens_k.to(torch.long)
    if int(cu_q[-1]) != q_len or int(cu_k[-1]) != kv_len:
        raise NotImplementedError(
            f"cu_seq_lens_q, cu_seq_lens_k: they cover {int(cu_q[-1])} queries and "
            f"{int(cu_k[-1])} keys, but the call has {q_len} and {kv_len} (astrai reads them as "
            "packed sequences of one batch row)"
        )
    segment_q = torch.searchsorted(cu_q[1:], torch.arange(q_len, device=cu_q.device), right=True)
    segment_k = torch.searchsorted(cu_k[1:], torch.arange(kv_len, device=cu_k.device), right=True)
    return (segment_q[:, None] == segment_k[None, :]).view(1, 1, q_len, kv_len)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, Dv]
    attention_mask: Optional[torch.Tensor],  # bool (True = attend) or additive, [B, 1, Lq, Lk]
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,  # attention sinks [Hq] (gpt-oss)
    sinks: Optional[torch.Tensor] = None,  # the same, named so by some models
    indices: Optional[torch.Tensor] = None,  # int32 [B, Lq, topk]: DeepSeek sparse attention
    **kwargs,
):
    """transformers' attention-function interface, run by astrai; returns ``([B, Lq, Hq, Dv],
    None)`` (astrai does not materialise attention weights)."""
    _check_kwargs(kwargs)
    if kwargs.get("output_attentions", False):
        raise NotImplementedError(
            "output_attentions: astrai attention does not return attention weights; use "
            "attn_implementation='eager' to get them"
        )
    window = _layer_window(module, sliding_window)
    sinks = _sinks(s_aux, sinks, query.shape[1])
    if _is_continuous_batching_call(kwargs):
        return _continuous_batching_forward(
            module, query, key, value, scaling, window, softcap, sinks, indices, kwargs
        )
    if dropout and dropout > 0.0:
        raise NotImplementedError(
            f"dropout: astrai attention has no dropout (got {dropout}); set the config's "
            "attention_dropout to 0 or use another attn_implementation for training with it"
        )

    q = query.transpose(1, 2)  # BLHD views, no copy
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    q_len, kv_len = q.shape[1], k.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    window_left = -1
    if mask is not None:
        # transformers' masks already hold causality, padding and the window (as for SDPA).
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        causal = False
    else:
        # No mask: transformers only skips it where SDPA's top-left causal flag is exact
        # (q_len == kv_len, or a single query that sees every key).
        causal = bool(causal) and q_len > 1
        if window is not None and window < kv_len:
            if not causal:
                raise NotImplementedError(
                    f"sliding_window: a window of {window} over {kv_len} keys without a mask "
                    "and without causality (astrai's window runs back from each query's "
                    "position: pass transformers' mask)"
                )
            window_left = window - 1
    if kwargs.get("cu_seq_lens_q") is not None:
        # Packed sequences (one row holding several): each query sees its own sequence only.
        if q.shape[0] != 1:
            raise NotImplementedError(
                f"cu_seq_lens_q: packed sequences in a batch of {q.shape[0]} rows (expected 1)"
            )
        cu_seq_lens_k = kwargs.get("cu_seq_lens_k")
        packed = _packed_sequences_mask(
            kwargs["cu_seq_lens_q"],
            kwargs["cu_seq_lens_q"] if cu_seq_lens_k is None else cu_seq_lens_k,
            q_len,
            kv_len,
        )
        if mask is None:
            mask = packed
        elif mask.dtype == torch.bool:
            mask = mask & packed
        else:
            mask = mask.masked_fill(~packed, float("-inf"))
    if indices is not None and indices.dtype != torch.int32:
        indices = indices.to(torch.int32)
    out = attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scaling,
        **_variant_arguments(window_left, softcap, sinks, indices),
    )
    return out, None


# Models that append additive biases to the mask they are given (DeepSeek V4 concatenates its
# compressed keys' block bias, 0 / -inf, cast to the mask's dtype: a bool mask would read it
# inverted). They get eager's additive mask, which astrai takes as well.
ADDITIVE_MASK_MODEL_TYPES = frozenset({"deepseek_v4"})


def attention_mask(*args, **kwargs):
    """The mask function registered for ``"astrai"``: SDPA's (bool, True = attend, or None
    where astrai's top-left causal flag is exact), which astrai's dense path takes as it is;
    eager's additive one for ``ADDITIVE_MASK_MODEL_TYPES``."""
    if getattr(kwargs.get("config"), "model_type", None) in ADDITIVE_MASK_MODEL_TYPES:
        return eager_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)


# -- continuous batching -------------------------------------------------------------------


@dataclass
class _PagedLayer:
    """One full-attention layer of transformers' paged cache, seen as astrai pools."""

    k_pages: torch.Tensor  # [P, S, Hkv, D], a view of transformers' cache
    v_pages: torch.Tensor  # [P, S, Hkv, Dv]
    group: int  # transformers' attention group (index into read/write indices)
    read_index: list  # per group: int64 [cached + new tokens] slots (token rows of the pool)
    write_index: list  # per group: int64 [new tokens] slots


class _PagedPools:
    """What ``astrai.extension.attention`` needs of a KV cache: the layer's pools and the step."""

    def __init__(self, k_pages: torch.Tensor, v_pages: torch.Tensor, step: StepMetadata):
        self.k_pages, self.v_pages, self.step = k_pages, v_pages, step

    def layer(self, layer_id: int):
        return self.k_pages, self.v_pages


class _StepMemo(threading.local):
    """The step metadata of the batch in flight, per transformers attention group. transformers
    builds a new write-index list for every batch, so that list identifies the step (held here,
    so its id cannot be reused while the memo lives)."""

    def __init__(self):
        self.step_key: Optional[list] = None
        self.by_group: Dict[Any, StepMetadata] = {}


_MEMO = _StepMemo()


def _memoized(step_key: list, group: Any, build) -> StepMetadata:
    if _MEMO.step_key is not step_key:
        _MEMO.step_key, _MEMO.by_group = step_key, {}
    meta = _MEMO.by_group.get(group)
    if meta is None:
        meta = _MEMO.by_group[group] = build()
    return meta


def _is_continuous_batching_call(kwargs: Dict[str, Any]) -> bool:
    return _PAGED_LAYER_KEY in kwargs or ("write_index" in kwargs and "cu_seq_lens_q" in kwargs)


def _cache_update_is_ours(cache) -> bool:
    """Up to transformers 5.18 the paged attention function writes the cache itself (the model
    passes the cache and the indices); from 5.19 on the model calls ``cache.update`` first."""
    cache_type = cache if isinstance(cache, type) else type(cache)
    return "read_index" in inspect.signature(cache_type.update).parameters


def _clear_pools(cache) -> None:
    """transformers 5.17 allocates its cache with torch.empty. A page's slots past a sequence's
    length are read but masked, and astrai's torch_native path (an SDPA over whole pages) lets a
    NaN there reach the output (0 * NaN); so zero the pools once, before the first step writes
    anything. Pages freed later hold finite keys and values of finished sequences."""
    for pool in list(cache.key_cache) + list(cache.value_cache):
        pool.zero_()
    cache._astrai_pools_cleared = True


def _update_cache_by_indices(cache, layer_idx: int, key, value, kwargs) -> None:
    """transformers 5.17 and 5.18: the attention function owns the cache update. Hand a
    full-attention layer's pools to astrai (which writes the new tokens itself), or let
    transformers write a rolling-buffer layer and gather its window. Leaves the layer's
    ``cu_seq_lens_k`` and ``max_length_k`` in kwargs, as the later update does."""
    if not getattr(cache, "_astrai_pools_cleared", False) and hasattr(cache, "key_cache"):
        _clear_pools(cache)
    pools = _full_attention_pools(cache, layer_idx, key.shape[1], key.shape[-1], value.shape[-1])
    layer_type = "full_attention" if pools is not None else "sliding_attention"
    kwargs["cu_seq_lens_k"] = _for_layer_type(kwargs["cu_seq_lens_k"], layer_type)
    max_k = _kwarg(kwargs, "max_length_k", "max_seqlen_k")
    kwargs["max_length_k"] = _for_layer_type(max_k, layer_type)
    if pools is not None:
        k_pages, v_pages, group = pools
        kwargs[_PAGED_LAYER_KEY] = _PagedLayer(
            k_pages, v_pages, group, kwargs["read_index"], kwargs["write_index"]
        )
        return
    k_all, v_all = cache.update(
        key_states=key,
        value_states=value,
        layer_idx=layer_idx,
        read_index=kwargs["read_index"],
        write_index=kwargs["write_index"],
    )
    if k_all.dim() == 3:  # [N, Hkv, D] (5.17) rather than [1, Hkv, N, D] (5.18)
        k_all, v_all = k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0)
    kwargs[_GATHERED_KEY] = (k_all, v_all)


def _full_attention_pools(
    cache, layer_idx: int, kv_heads: int = 0, head_dim: int = 0, head_dim_v: int = 0
):
    """``(k_pages, v_pages, group)`` of a full-attention layer, views ``[P, S, Hkv, D]`` of
    transformers' cache, or None for a layer that transformers keeps in a rolling buffer. The
    layer's own kv heads and head dims (its new k/v's; Gemma 4's differ between layers) shape
    transformers 5.17's flat tensors; later versions hand out per-layer views."""
    allocators = getattr(cache, "layer_to_allocator", None)
    if allocators is None:  # transformers 5.17: one flat tensor per layer of a group
        group, index_in_group = cache.layer_index_to_group_indices[layer_idx]
        if cache.sliding_windows[layer_idx] != 1:
            return None
        k_pages = cache.key_cache[index_in_group].view(-1, cache.block_size, kv_heads, head_dim)
        v_pages = cache.value_cache[index_in_group].view(-1, cache.block_size, kv_heads, head_dim_v)
        return k_pages, v_pages, group
    allocator = allocators[layer_idx]
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator,
    )

    if type(allocator) is not FullAttentionCacheAllocator:  # sliding window, latent (MLA), ...
        return None
    if hasattr(allocator, "get_cache_for_block_table"):
        k_pages, v_pages = allocator.get_cache_for_block_table(layer_idx)
    else:  # transformers 5.18
        _, k_pages, v_pages = cache.get_cache_for_block_table(layer_idx)
    return k_pages, v_pages, allocator.index


def _full_attention_step(
    read_index: torch.Tensor,  # int64 [N]: slots of every sequence's cached + new tokens, in order
    write_index: torch.Tensor,  # int64 [>= T]: slots of the new tokens
    cu_seq_lens_q: torch.Tensor,  # [B + 1]
    cu_seq_lens_k: torch.Tensor,  # [B + 1]
    max_query_len: int,
    max_kv_len: int,
    num_tokens: int,
    page_size: int,
) -> StepMetadata:
    """astrai's paged-step metadata from transformers' indices, with device ops only. A
    sequence's pages are every ``page_size``-th entry of its read indices (transformers reads
    whole pages in order); a batch without cached tokens has no read indices, and its new tokens
    start at position 0, so its write indices give the pages."""
    batch = cu_seq_lens_q.numel() - 1
    query_start_loc = cu_seq_lens_q.to(torch.int32)
    cu_k = cu_seq_lens_k.to(torch.int32)
    seq_lens = cu_k[1:] - cu_k[:-1]
    if read_index.numel() > 0:
        slots, starts = read_index, cu_k[:-1]
    else:
        slots, starts = write_index, query_start_loc[:-1]
    width = max(1, -(-max_kv_len // page_size))
    offsets = torch.arange(width, device=slots.device, dtype=torch.int64) * page_size
    first_slots = (starts.to(torch.int64)[:, None] + offsets).clamp_(max=slots.numel() - 1)
    block_table = torch.div(slots[first_slots], page_size, rounding_mode="floor").to(torch.int32)
    slot_mapping = write_index[:num_tokens].to(torch.int32)
    decode = max_query_len == 1 and num_tokens == batch
    return StepMetadata(
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        slot_mapping=slot_mapping,
        max_query_len=max_query_len,
        mode="decode" if decode else "prefill",
    )


def _gathered_step(
    cu_seq_lens_q: torch.Tensor,  # [B + 1]
    cu_seq_lens_k: torch.Tensor,  # [B + 1]: segments of the gathered keys
    max_query_len: int,
    max_kv_len: int,
    num_tokens: int,
    num_keys: int,
) -> StepMetadata:
    """Metadata that reads the keys transformers gathered (one segment per sequence, its new
    tokens last) as a paged cache of one token per page."""
    batch = cu_seq_lens_q.numel() - 1
    cu_k = cu_seq_lens_k.to(torch.int32)
    width = max(1, max_kv_len)
    positions = torch.arange(width, device=cu_k.device, dtype=torch.int32)
    block_table = (cu_k[:-1, None] + positions).clamp_(max=max(num_keys - 1, 0))
    decode = max_query_len == 1 and num_tokens == batch
    return StepMetadata(
        block_table=block_table,
        seq_lens=cu_k[1:] - cu_k[:-1],
        query_start_loc=cu_seq_lens_q.to(torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int32, device=cu_k.device),
        max_query_len=max_query_len,
        mode="decode" if decode else "prefill",
    )


def _window_mask(step: StepMetadata, num_tokens: int, window: int) -> torch.Tensor:
    """bool ``[T, K]``: new token i of a sequence (at position seq_len - q_len + i) sees the
    ``window`` positions up to itself. For an astrai without ``window_left``."""
    device = step.seq_lens.device
    q_lens = step.query_start_loc[1:] - step.query_start_loc[:-1]
    batch = q_lens.numel()
    sequence = torch.repeat_interleave(
        torch.arange(batch, device=device), q_lens, output_size=num_tokens
    )
    index_in_sequence = torch.arange(num_tokens, device=device) - step.query_start_loc[sequence]
    positions = (step.seq_lens - q_lens)[sequence] + index_in_sequence
    keys = torch.arange(step.block_table.shape[1], device=device)
    return (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)


def _topk_within_sequences(
    indices: torch.Tensor,  # [1, T, topk]: positions along the step's gathered keys
    cu_seq_lens_q: torch.Tensor,  # [B + 1]
    cu_seq_lens_k: torch.Tensor,  # [B + 1]: each sequence's segment of the gathered keys
) -> torch.Tensor:
    """astrai's ``[T, topk]`` positions within each token's sequence, from transformers'
    continuous-batching indices. There a layer's keys are every sequence's tokens gathered one
    after another (``cu_seq_lens_k`` segments) under a block-diagonal mask, so an index is a
    position along that axis, as in the dense path; an entry outside the token's own segment
    is masked there, and becomes -1 (unused) here."""
    tokens = indices.shape[1]
    cu_q, cu_k = cu_seq_lens_q.to(torch.long), cu_seq_lens_k.to(torch.long)
    token = torch.arange(tokens, device=cu_q.device)
    sequence = torch.searchsorted(cu_q[1:], token, right=True).clamp_(max=cu_q.numel() - 2)
    start, end = cu_k[sequence], cu_k[sequence + 1]
    position = indices[0].to(torch.long) - start[:, None]
    inside = (indices[0] >= 0) & (position >= 0) & (position < (end - start)[:, None])
    return torch.where(inside, position, -1).to(torch.int32)


def _continuous_batching_forward(
    module, query, key, value, scaling, window, softcap, sinks, indices, kwargs
):
    """One layer of a continuous-batching step: q/k/v are ``[1, H, T, D]`` (the batch's new
    tokens packed)."""
    q_tokens = query[0].transpose(0, 1)  # [T, Hq, D]
    num_tokens = q_tokens.shape[0]
    cu_seq_lens_q = kwargs["cu_seq_lens_q"]
    max_query_len = int(_kwarg(kwargs, "max_length_q", "max_seqlen_q"))
    variants = _variant_arguments(softcap=softcap, sinks=sinks)

    cache = kwargs.get("cache")
    if cache is not None and not kwargs.pop(_UPDATED_KEY, False):
        # transformers up to 5.24 leaves the cache update to the attention function (5.19 on
        # through the kwargs, where our update hook answers); 5.25 updates it in the model.
        if _cache_update_is_ours(cache):
            _update_cache_by_indices(cache, module.layer_idx, key, value, kwargs)
            key, value = kwargs.pop(_GATHERED_KEY, (key, value))
        else:
            key, value = cache.update(
                key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs
            )
    layer: Optional[_PagedLayer] = kwargs.pop(_PAGED_LAYER_KEY, None)
    cu_seq_lens_k = kwargs["cu_seq_lens_k"]  # this layer's, once the cache is updated
    max_kv_len = int(kwargs["max_length_k"])
    if indices is not None:
        variants.update(
            _variant_arguments(
                topk_indices=_topk_within_sequences(indices, cu_seq_lens_q, cu_seq_lens_k)
            )
        )
    mask = None
    if layer is not None:  # full attention: transformers' pages, read and written in place
        k_pages, v_pages = layer.k_pages, layer.v_pages
        read_index = layer.read_index[layer.group]
        write_index = layer.write_index[layer.group]
        step = _memoized(
            layer.write_index,
            layer.group,
            lambda: _full_attention_step(
                read_index,
                write_index,
                cu_seq_lens_q,
                cu_seq_lens_k,
                max_query_len,
                max_kv_len,
                num_tokens,
                k_pages.shape[1],
            ),
        )
        torch.ops.astr.append_kv(
            key[0].transpose(0, 1), value[0].transpose(0, 1), k_pages, v_pages, step.slot_mapping
        )
    else:  # a rolling-buffer layer: transformers gathered its window, [1, Hkv, N, D]
        k_pages = key[0].transpose(0, 1).unsqueeze(1)  # [N, 1, Hkv, D]: one token per page
        v_pages = value[0].transpose(0, 1).unsqueeze(1)
        step = _gathered_step(
            cu_seq_lens_q, cu_seq_lens_k, max_query_len, max_kv_len, num_tokens, k_pages.shape[0]
        )
        if window is None:  # a model that passes no window: its config's
            config = getattr(module, "config", None)
            window = _layer_window(module, getattr(config, "sliding_window", None))
        if window is not None:
            if "window_left" in _ATTENTION_PARAMETERS:
                variants["window_left"] = window - 1
            else:
                mask = _window_mask(step, num_tokens, window)

    out = attention(
        q_tokens.unsqueeze(0),  # [1, T, Hq, D]: the ragged batch packed
        None,
        None,
        kv_cache=_PagedPools(k_pages, v_pages, step),
        attn_mask=mask,
        is_causal=True,
        fwd=step.mode,
        scale=scaling,
        **variants,
    )
    return out, None


# -- hooks for transformers >= 5.19, where the model updates the cache before attention -----


def _install_continuous_batching_hooks() -> None:
    """From transformers 5.19 on, continuous batching accepts only its own implementations, and
    the model calls ``cache.update`` (which writes the new tokens and gathers every sequence's
    keys into a new tensor) before the attention function. For models set to astrai, let the
    manager keep astrai, and make ``update`` hand full-attention layers' pools to astrai
    instead (astrai writes the new tokens and reads the pages in place)."""
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if _cache_update_is_ours(PagedAttentionCache):
        return  # transformers <= 5.18: "paged|astrai" is called with the cache and the indices
    manager = continuous_api.ContinuousBatchingManager
    original_switch = manager.switch_to_cb_friendly_attn
    if not getattr(original_switch, "_astrai_hook", False):

        def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
            if model.config._attn_implementation in _NAMES:
                return None  # astrai runs continuous batching itself
            return original_switch(self, model, *args, **kwargs)

        switch_to_cb_friendly_attn._astrai_hook = True
        manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn

    original_update = PagedAttentionCache.update
    if not getattr(original_update, "_astrai_hook", False):

        @torch.compiler.disable
        def update(self, key_states, value_states, layer_idx, kwargs):
            if (
                getattr(self.config, "_attn_implementation", None) not in _NAMES
                or kwargs.get("block_table") is not None
            ):
                return original_update(self, key_states, value_states, layer_idx, kwargs)
            kwargs[_UPDATED_KEY] = True
            pools = _full_attention_pools(self, layer_idx)
            if pools is None:  # rolling buffer: transformers gathers the window
                return original_update(self, key_states, value_states, layer_idx, kwargs)
            k_pages, v_pages, group = pools
            layer_type = "full_attention"
            kwargs["cu_seq_lens_k"] = _for_layer_type(kwargs["cu_seq_lens_k"], layer_type)
            kwargs["max_length_k"] = _for_layer_type(kwargs["max_length_k"], layer_type)
            kwargs[_PAGED_LAYER_KEY] = _PagedLayer(
                k_pages, v_pages, group, kwargs["read_index"], kwargs["write_index"]
            )
            return key_states, value_states  # written by astrai's append_kv

        update._astrai_hook = True
        PagedAttentionCache.update = update


def _install_backend_context_hook() -> None:
    """Continuous batching runs the model on transformers' own thread, and astrai's
    ``attn_backend`` contexts belong to a thread (or task): carry the contexts of the one that
    starts the manager (``generate_batch``, ``init_continuous_batching``) over to its loop."""
    from transformers.generation.continuous_batching import continuous_api

    manager = continuous_api.ContinuousBatchingManager
    original_start = manager.start
    if getattr(original_start, "_astrai_hook", False):
        return

    def start(self, *args, **kwargs):
        self._astrai_backends = task_backends()
        return original_start(self, *args, **kwargs)

    original_loop = manager._run_generation_loop

    def _run_generation_loop(self, *args, **kwargs):
        with contextlib.ExitStack() as contexts:
            for backend in getattr(self, "_astrai_backends", ()):
                contexts.enter_context(attn_backend(backend))
            return original_loop(self, *args, **kwargs)

    start._astrai_hook = True
    manager.start = start
    manager._run_generation_loop = _run_generation_loop


def _check_version() -> None:
    version = Version(transformers.__version__)
    low, high = (Version(bound.lstrip("<>=")) for bound in TESTED_TRANSFORMERS)
    if not low <= version < high:
        warnings.warn(
            f"astrai.integrations.transformers is tested with transformers "
            f"{','.join(TESTED_TRANSFORMERS)}, found {transformers.__version__}; dense attention "
            "should work, continuous batching depends on transformers internals",
            stacklevel=3,
        )


def register() -> None:
    """Register ``"astrai"`` and ``"paged|astrai"`` with transformers (idempotent)."""
    _check_version()
    AttentionInterface.register(NAME, attention_forward)
    AttentionInterface.register(PAGED_NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    AttentionMaskInterface.register(PAGED_NAME, attention_mask)
    _install_continuous_batching_hooks()
    _install_backend_context_hook()


__all__ = [
    "NAME",
    "PAGED_NAME",
    "TESTED_TRANSFORMERS",
    "TRANSFORMERS_PAGED",
    "attention_forward",
    "attention_mask",
    "register",
]
