"""The public attention API: ``attention``, ``attn_backend``, ``get_backend``, ``explain``.

Every choice among the built-in backends is made by the C++ resolver (csrc/dispatch):
per-call ``backend=`` > ``attn_backend(...)`` context (task-local: see ``attn_backend``) >
``ASTR_BACKEND`` > default priority cuda > flash > torch_native. An explicit choice (argument
or context) is strict; ASTR_BACKEND and the default fall back to the next capable backend.
Backends written in Python are run here, since C++ cannot call them.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch

from .base import (
    NATIVE_ENTRIES,
    TASK_CONTEXTS,
    THREAD_CONTEXTS,
    AttentionBackend,
    ContextEntry,
    pop_context,
    push_context,
    task_context,
    thread_context,
)
from .builtin import BuiltinBackend
from .call import NO_VARIANTS, Variants, attention_op_args, paged_query_tokens, run_builtin
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


_BUILTIN_NAMES = frozenset(backend.value for backend in ATTN_BACKEND)

BackendSpec = Union[str, ATTN_BACKEND, AttentionBackend, type, None]


def _as_backend(spec: BackendSpec) -> AttentionBackend:
    if isinstance(spec, AttentionBackend):
        return spec
    if isinstance(spec, ATTN_BACKEND):
        return AttentionBackendFactory.create(spec.value)
    if isinstance(spec, str):
        return AttentionBackendFactory.create(spec)
    if isinstance(spec, type) and issubclass(spec, AttentionBackend):
        return _instance(spec)
    raise TypeError(
        f"backend: expected a name, ATTN_BACKEND, AttentionBackend class or instance, got {spec!r}"
    )


class attn_backend:
    """Select a backend for the calls made inside the ``with`` block. Strict: a call it cannot
    run raises, naming every backend and why it was rejected.

    Task-local for calls through this module (``attention``, ``explain``, ``get_backend``): a
    thread sees only its own contexts, and an asyncio task only its own and those open where it
    was created. Compiled code and direct ``torch.ops.astr`` calls see the thread's innermost
    open context, whichever task entered it (torch.compile cannot guard on a contextvar). An
    exit removes its own context, in whatever order contexts are exited."""

    def __init__(self, backend: BackendSpec):
        self.backend = _as_backend(backend)
        self._entries: List[ContextEntry] = []  # one per entry of this object still open

    def __enter__(self) -> AttentionBackend:
        self._entries.append(push_context(self.backend))
        return self.backend

    def __exit__(self, *exc_info):
        if not self._entries:
            raise RuntimeError(f"attn_backend: {self.backend!r} is not an open context here")
        pop_context(self.backend, self._entries.pop())
        return False


# Bound once: the two functions below run on every call, where each attribute lookup shows.
_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_task_contexts = TASK_CONTEXTS.get


def _context_entry() -> Optional[ContextEntry]:
    """The context a call runs under: the task's, except while dynamo traces: the thread's (it
    cannot read a contextvar, and can guard on the thread's list)."""
    if _is_dynamo_compiling():
        return thread_context()
    return task_context()


# The op's backend_source numbers (csrc/dispatch/resolver.h: SelectionSource); 0: not observed.
_ARGUMENT, _CONTEXT, _ENVIRONMENT, _DEFAULT = 1, 2, 3, 4


def _environment_selection() -> Tuple[Optional[str], int]:
    """ASTR_BACKEND as the op's (backend, backend_source), read here; the op warns about (and
    ignores) a name that is not a backend."""
    value = os.environ.get("ASTR_BACKEND", "")
    return (value, _ENVIRONMENT) if value else (None, _DEFAULT)


def _op_selection(name: Optional[str], observed: Optional[Tuple[Optional[str], int]]) -> dict:
    """The op's selection keyword arguments: a per-call backend name, else what the caller
    observed of the thread's context and ASTR_BACKEND, else none (the op reads them itself)."""
    if name is not None:
        return {"backend": name, "backend_source": _ARGUMENT}
    if observed is not None:
        return {"backend": observed[0], "backend_source": observed[1]}
    return {}


def get_backend(use_default: bool = True) -> Optional[AttentionBackend]:
    """The selected backend: the innermost ``attn_backend`` context, else ASTR_BACKEND when it
    names a backend that can run here, else (when ``use_default``) the first available backend
    in priority order. An ASTR_BACKEND that cannot run here (e.g. ``cuda`` without a GPU) is
    skipped, as calls skip it."""
    entry = _context_entry()
    if entry is not None:
        return entry.backend
    if not THREAD_CONTEXTS.entries:
        selected, source = torch.ops.astr.selected_backend()  # warns once about an unknown name
    else:  # another task's context is on this thread's C++ stack: read the environment here
        selected, source = _environment_selection()
    name = selected if source == _ENVIRONMENT else ""
    if name in _BUILTIN_NAMES:
        backend = AttentionBackendFactory.create(name)
        if backend.available():
            return backend
    if not use_default:
        return None
    return _priority_backends()[0]


def _python_backend(backend: BackendSpec) -> Optional[AttentionBackend]:
    """The backend written in Python that must run this call, if any."""
    if backend is None:
        if _is_dynamo_compiling():  # dynamo cannot read a contextvar
            entry = thread_context()
        else:  # (task_context, inlined where nothing was withdrawn: this runs on every call)
            entries = _task_contexts()
            entry = entries[-1] if entries else None
            if entry is not None and entry.withdrawn:
                entry = task_context()
        chosen = entry.backend if entry is not None else None
    else:
        chosen = _as_backend(backend)
    if chosen is not None and not isinstance(chosen, BuiltinBackend):
        return chosen
    return None


def _builtin_name(backend: BackendSpec) -> Optional[str]:
    if backend is None:
        return None
    return _as_backend(backend).name


_flash_probed = False


def _ensure_probed() -> None:
    """Probe flash-attn once, in eager code. Under torch.compile the probe (an import) is
    skipped; the guard on ``_flash_probed`` recompiles once a later eager call has probed."""
    global _flash_probed
    if not _flash_probed and not torch.compiler.is_compiling():
        probe_flash()
        _flash_probed = True


# os.environ's backing dict: torch.compile guards on reads of a plain dict, not on
# os.environ.get, so a change of ASTR_BACKEND recompiles instead of reusing a stale graph.
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = b"ASTR_BACKEND" if _ENVIRON is not None and os.name == "posix" else "ASTR_BACKEND"


_ENV_CHOICES = tuple(
    (n.encode() if isinstance(_ENV_KEY, bytes) else n) for n in ("cuda", "flash", "torch_native")
)


def _observed_selection() -> Optional[Tuple[Optional[str], int]]:
    """The selection the op must use instead of reading the thread's C++ override stack, as its
    (backend, backend_source) arguments; None: the op reads them itself.

    Eager code: None (the C++ resolver reads the stack and ASTR_BACKEND itself) unless the
    stack's top is another task's context; then this task's context, or ASTR_BACKEND.

    While torch.compile traces: the thread's context and ASTR_BACKEND, read in Python so that
    the compiler guards on them, and passed to the op so that the graph records them (a cached
    graph traced under another selection is then never reused)."""
    if not _is_compiling():  # runs on every call: kept to a few lookups
        task = _task_contexts()
        if not task and not NATIVE_ENTRIES:
            return None  # no context anywhere
        on_thread = THREAD_CONTEXTS.entries  # the C++ stack's mirror: its top is what C++ reads
        top = task[-1] if task else None
        if top is not None and top.withdrawn:
            top = task_context()
        if top is None:
            return _environment_selection() if on_thread else None
        if on_thread and on_thread[-1] is top:
            return None
        return (top.backend.name, _CONTEXT)  # a Python backend never reaches here
    entry = _context_entry()
    if entry is not None:  # a Python backend on top never reaches here (see attention)
        return (entry.backend.name, _CONTEXT)
    if _ENVIRON is None:
        return (None, _DEFAULT)
    value = _ENVIRON.get(_ENV_KEY)
    for choice in _ENV_CHOICES:  # comparing makes the compiler guard on the value
        if value == choice:
            name = choice.decode() if isinstance(choice, bytes) else choice
            return (name, _ENVIRONMENT)
    return (None, _DEFAULT)


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
):
    """Attention over BLHD q/k/v (``[batch, seq_len, heads, head_dim]``).

    ``fwd=None``: a training call (no cache, differentiable). ``fwd="prefill"``/``"decode"``
    with ``kv_cache``: k/v (the new tokens) are appended to layer ``layer_id``'s pools, then q
    attends over the cache using the metadata of ``kv_cache.begin_step(...)``; for a ragged
    prefill pack the batch's new tokens along dim 1 (``[1, T, heads, head_dim]``).

    Variants: ``window_left=W >= 0`` (with ``is_causal``) lets a query at absolute position p
    see keys p - W .. p (positions top-left aligned for dense calls, ``seq_len - q_len + i``
    for paged ones); ``softcap=c`` turns each score s = scale * q.k into c * tanh(s / c);
    ``sinks`` (float32 ``[heads]``) adds one logit per query head to its softmax denominator,
    with no value. ``return_lse=True`` returns ``(out, lse)``: lse float32, out's shape without
    its last dim, the natural log of each row's softmax denominator (sink included; -inf for a
    row that sees no key, whose out is 0). ``merge_states`` combines two such partial results.
    """
    _ensure_probed()
    variants = Variants(window_left, softcap, sinks, return_lse)
    python_backend = _python_backend(backend)
    if python_backend is not None:
        if variants != NO_VARIANTS:
            raise ValueError(
                f"{type(python_backend).__name__} is written in Python: window_left, softcap, "
                "sinks and return_lse run only on the built-in backends"
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
    name = _builtin_name(backend)
    selection = _op_selection(name, _observed_selection() if name is None else None)
    return run_builtin(
        q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd, selection, scale, variants
    )


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

    def __str__(self) -> str:
        lines = [
            f"backend: {self.backend or 'none'} (selection: {self.source}"
            + (f" '{self.requested}'" if self.requested else "")
            + ")"
        ]
        for name, reasons in self.rejected.items():
            lines.append(f"  {name}: " + ("; ".join(reasons) if reasons else "can run it"))
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
) -> Decision:
    """The resolver's decision for a call, without running it (nothing is appended)."""
    _ensure_probed()
    python_backend = _python_backend(backend)
    if python_backend is not None:
        return Decision(type(python_backend).__name__, "argument" if backend else "context")
    name = _builtin_name(backend)
    selection = _op_selection(name, _observed_selection() if name is None else None)
    variant_args = dict(
        window_left=window_left, softcap=softcap, sinks=sinks, return_lse=return_lse
    )
    if kv_cache is None:
        text = torch.ops.astr.explain(
            q,
            k,
            v,
            attn_mask,
            is_causal,
            scale,
            mode=fwd,
            **selection,
            **variant_args,
        )
    else:
        k_pool, v_pool = kv_cache.layer(layer_id)
        q_tokens = paged_query_tokens(q)
        text = torch.ops.astr.explain(
            q_tokens,
            None,
            None,
            k_cache=k_pool,
            v_cache=v_pool,
            **selection,
            **attention_op_args(q, kv_cache, attn_mask, is_causal, fwd, scale, layer_id),
            **variant_args,
        )
    data = json.loads(text)
    return Decision(
        data["backend"],
        data["source"],
        data["requested"],
        data["fell_back"],
        data["error"],
        data["reasons"],
    )
