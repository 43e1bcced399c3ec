"""The public attention API: ``attention``, ``explain``, ``merge_states`` (and, from
astrai.extension.selection, ``attn_backend`` and ``get_backend``).

Every choice among the built-in backends is made by the C++ resolver (csrc/dispatch):
per-call ``backend=`` > ``attn_backend(...)`` context (task-local: see ``attn_backend``) >
``ASTR_BACKEND`` > default priority cuda > flash > torch_native. An explicit choice (argument
or context) is strict; ASTR_BACKEND and the default fall back to the next capable backend.
What a call selected is observed once, in astrai.extension.selection, and handed to the op.
Backends written in Python are run here, since C++ cannot call them.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..selection import BackendSpec, attn_backend, get_backend, observe
from .base import AttentionBackend
from .call import op_arguments, options_off_default, run_builtin
from .cuda import CudaBackend
from .factory import AttentionBackendFactory, _instance
from .flash import FlashAttnBackend, probe_flash
from .registry import ATTN_BACKEND, BUILTIN_BACKENDS
from .torch_native import TorchNativeBackend

__all__ = [
    "ATTN_BACKEND",
    "AttentionBackend",
    "AttentionBackendFactory",
    "CudaBackend",
    "Decision",
    "FlashAttnBackend",
    "TorchNativeBackend",
    "attention",
    "attn_backend",
    "explain",
    "get_backend",
    "merge_states",
]


def flash_attn_available() -> bool:
    """Whether the flash-attn package can be used here (probed once, lazily)."""
    return probe_flash().available


def _is_available(cls) -> bool:
    # flash's availability is asked through flash_attn_available, the hook that the backend
    # contract (tests/extension/test_backend.py) replaces.
    return flash_attn_available() if cls is FlashAttnBackend else cls.available()


@functools.cache
def _priority_backends() -> List[AttentionBackend]:
    """The available built-in backends, in default priority order (registry.py's list)."""
    return [_instance(cls) for cls in BUILTIN_BACKENDS if _is_available(cls)]


_flash_probed = False


def _ensure_probed() -> None:
    """Probe flash-attn once, in eager code. Under torch.compile the probe (an import) is
    skipped; the guard on ``_flash_probed`` recompiles once a later eager call has probed."""
    global _flash_probed
    if not _flash_probed and not torch.compiler.is_compiling():
        probe_flash()
        _flash_probed = True


def call_options(
    attn_mask,
    is_causal,
    scale,
    window_left,
    softcap,
    sinks,
    return_lse,
    topk_indices,
    tree_mask,
) -> dict:
    """The op's arguments of an ``attention`` / ``explain`` call beyond its tensors and
    selection, by name (call.py leaves out those at the schema's defaults)."""
    return dict(
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        window_left=window_left,
        softcap=softcap,
        sinks=sinks,
        return_lse=return_lse,
        topk_indices=topk_indices,
        tree_mask=tree_mask,
    )


# What a backend written in Python receives (AttentionBackend.forward); every other option runs
# only on the built-in backends.
PYTHON_BACKEND_OPTIONS = ("attn_mask", "is_causal")


def _topk_rows(topk_indices, kv_cache):
    """topk_indices as the op takes them: over a cache one row per query token, ``[T, topk]``
    (the API's q is ``[..., T-ish, heads, head_dim]``, flattened to tokens the same way)."""
    if topk_indices is None or kv_cache is None or topk_indices.dim() < 3:
        return topk_indices
    return topk_indices.flatten(0, -2)


def attention(
    q,
    k,
    v,
    kv_cache=None,
    layer_id=0,
    attn_mask=None,
    is_causal=False,
    fwd=None,
    backend: BackendSpec = None,
    scale: Optional[float] = None,
    window_left: int = -1,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    topk_indices: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
):
    """Attention over BLHD q/k/v (``[batch, seq_len, heads, head_dim]``).

    ``fwd=None``: a training call (no cache, differentiable). ``fwd="prefill"``/``"decode"``
    with ``kv_cache``: once the call's arguments and backend are checked, k/v (the new tokens)
    are appended to layer ``layer_id``'s pools, then q attends over the cache using the metadata
    of ``kv_cache.begin_step(...)`` (a refused call writes nothing); for a ragged prefill pack
    the batch's new tokens along dim 1 (``[1, T, heads, head_dim]``).

    Variants: ``window_left=W >= 0`` (with ``is_causal``) lets a query at absolute position p
    see keys p - W .. p (positions top-left aligned for dense calls, ``seq_len - q_len + i``
    for paged ones); ``softcap=c`` turns each score s = scale * q.k into c * tanh(s / c);
    ``sinks`` (float32 ``[heads]``) adds one logit per query head to its softmax denominator,
    with no value. ``return_lse=True`` returns ``(out, lse)``: lse float32, out's shape without
    its last dim, the natural log of each row's softmax denominator (sink included; -inf for a
    row that sees no key, whose out is 0). ``merge_states`` combines two such partial results.
    ``topk_indices`` (int32, shared by all heads; DeepSeek sparse attention): the key positions
    each query row may see, ``[batch, q_len, topk]`` for dense calls (positions along k's
    length), q's leading dims plus ``topk`` over a cache (positions within the row's sequence,
    0 .. seq_len - 1); -1 marks an unused entry, a position listed twice counts once, and the
    row sees exactly the listed keys that its mask, causality and window also allow.

    ``tree_mask`` (speculative decoding's verify of a tree of drafts; ``fwd="prefill"`` over
    ``kv_cache``, ``is_causal=True``): bool ``[T, max_query_len]`` over the step's new tokens,
    row t for new token t of the step, column j for new token j of that token's own sequence
    (``kv_cache.step.max_query_len`` columns). A new token sees its sequence's cached prefix and
    exactly the new tokens its row names (the lower triangle is the causal mask); window,
    softcap, sinks, lse and an FP8 cache apply as usual. Not with ``attn_mask``.
    """
    _ensure_probed()
    selection = observe(backend)
    options = call_options(
        attn_mask,
        is_causal,
        scale,
        window_left,
        softcap,
        sinks,
        return_lse,
        _topk_rows(topk_indices, kv_cache),
        tree_mask,
    )
    python_backend = selection.python_backend
    if python_backend is not None:
        unsupported = [n for n in options_off_default(options) if n not in PYTHON_BACKEND_OPTIONS]
        if "scale" in unsupported and math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-12):
            unsupported.remove("scale")  # the scale such a backend applies (1/sqrt(head_dim))
        if unsupported:
            raise ValueError(
                f"{type(python_backend).__name__} is written in Python: "
                f"{', '.join(unsupported)} run only on the built-in backends"
            )
        return python_backend.forward(
            q,
            k,
            v,
            kv_cache=kv_cache,
            layer_id=layer_id,
            attn_mask=attn_mask,
            is_causal=is_causal,
            fwd=fwd,
        )
    return run_builtin(q, k, v, kv_cache, layer_id, fwd, selection, options)


def merge_states(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions over disjoint key sets exactly: ``out`` ``[..., D]`` and
    ``lse`` ``[...]`` (float32, natural log, as ``attention(..., return_lse=True)`` returns
    them; -inf for a row that saw no key). Returns ``(out, lse)`` of the union."""
    return torch.ops.astr.merge_states(out_a, lse_a, out_b, lse_b)


@dataclass
class Decision:
    """Which backend a call would run on, and why each other one was not taken."""

    backend: Optional[str]
    source: str  # "argument", "context", "environment" or "default"
    requested: str = ""
    fell_back: bool = False
    error: str = ""
    rejected: Dict[str, List[str]] = field(default_factory=dict)
    # The measured preference that ordered a default choice (the run and rows), "" where none did.
    preference: str = ""
    # The cuda backend's kernel form, in csrc/README.md's kernel table's words, where the
    # explanation asks its plan (explain_mla: "tensor_core/split x4", "simple"); "" otherwise.
    kernel: str = ""

    @classmethod
    def from_json(cls, text: str) -> Decision:
        """The decision the resolver wrote (``astr::dispatch::Decision::to_json``)."""
        data = json.loads(text)
        return cls(
            data["backend"],
            data["source"],
            data["requested"],
            data["fell_back"],
            data["error"],
            data["reasons"],
            data["preference"],
        )

    def __str__(self) -> str:
        lines = [
            f"backend: {self.backend or 'none'} (selection: {self.source}"
            + (f" '{self.requested}'" if self.requested else "")
            + ")"
        ]
        for name, reasons in self.rejected.items():
            lines.append(f"  {name}: " + ("; ".join(reasons) if reasons else "can run it"))
        if self.preference:
            lines.append(f"  measured preference: {self.preference}")
        if self.kernel:
            lines.append(f"  kernel: {self.kernel}")
        if self.error:
            lines.append(f"  error: {self.error}")
        return "\n".join(lines)


def explain(
    q,
    k=None,
    v=None,
    kv_cache=None,
    layer_id=0,
    attn_mask=None,
    is_causal=False,
    fwd=None,
    backend: BackendSpec = None,
    scale: Optional[float] = None,
    window_left: int = -1,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    topk_indices: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
) -> Decision:
    """The resolver's decision for a call, without running it (nothing is appended)."""
    _ensure_probed()
    selection = observe(backend)
    if selection.python_backend is not None:
        return Decision(type(selection.python_backend).__name__, selection.source.name.lower())
    options = call_options(
        attn_mask,
        is_causal,
        scale,
        window_left,
        softcap,
        sinks,
        return_lse,
        _topk_rows(topk_indices, kv_cache),
        tree_mask,
    )
    args = op_arguments(q, k, v, kv_cache, layer_id, fwd, selection, options)
    return Decision.from_json(torch.ops.astr.explain(**args))
