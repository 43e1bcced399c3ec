"""The AttentionBackend interface: what every backend, built-in or written in Python, offers."""

from __future__ import annotations

import contextvars
import threading
from typing import List, Optional, Tuple

import torch


class ContextEntry:
    """One entered ``attn_backend(...)`` context: its backend, the id of its entry on the C++
    override stack of the thread that entered it, and whether it has been exited (``open``),
    from a task or thread other than the one that entered it (``withdrawn``: then every view
    drops it, since that exit could not reach the entering task's own view)."""

    def __init__(self, backend: AttentionBackend, native_id: int):
        self.backend = backend
        self.native_id = native_id
        self.open = True
        self.withdrawn = False


# The contexts the current task (or thread, outside asyncio) has entered, innermost last. A
# tuple: an asyncio task copies the contexts open where it was created and keeps them even after
# its creator exits them (contextvars' semantics); neither sees the other's later changes. Each
# reader skips withdrawn entries.
TASK_CONTEXTS: contextvars.ContextVar[Tuple[ContextEntry, ...]] = contextvars.ContextVar(
    "astrai_attn_backend_contexts", default=()
)


class _ThreadContexts(threading.local):
    """The contexts entered on this thread by any of its tasks and not yet exited, in order:
    the mirror of the C++ override stack, which direct torch.ops calls and torch.compile (it
    cannot guard on a contextvar) see."""

    def __init__(self):
        self.entries: List[ContextEntry] = []


THREAD_CONTEXTS = _ThreadContexts()


# One item per entry that the C++ override stacks of all threads hold (a list: its append and pop
# are atomic, so threads need no lock). Empty lets a call skip reading its thread's stack: the
# common case, checked on every call.
NATIVE_ENTRIES: List[None] = []


def task_context() -> Optional[ContextEntry]:
    """The innermost context of the calling task (eager code)."""
    entries = TASK_CONTEXTS.get()
    for index in range(len(entries) - 1, -1, -1):  # usually returns at once
        if not entries[index].withdrawn:
            return entries[index]
    return None


def task_backends() -> List[AttentionBackend]:
    """The backends of the calling task's contexts, outermost first: what code that runs the
    task's work on another thread enters again there."""
    return [entry.backend for entry in TASK_CONTEXTS.get() if not entry.withdrawn]


def thread_context() -> Optional[ContextEntry]:
    """The innermost context entered on this thread by any task and not yet exited: what the
    C++ resolver reads for a call that does not pass its selection."""
    entries = THREAD_CONTEXTS.entries
    for index in range(len(entries) - 1, -1, -1):  # usually returns at once
        if entries[index].open:  # one exited on another thread waits here to be dropped
            return entries[index]
    return None


def _drop_exited(entries: List[ContextEntry]) -> None:
    """Removes the entries exited on other threads from this thread's mirror and C++ stack."""
    if all(e.open for e in entries):
        return
    for entry in [e for e in entries if not e.open]:
        entries.remove(entry)
        torch.ops.astr.pop_backend(entry.native_id)
        NATIVE_ENTRIES.pop()


def push_context(backend: AttentionBackend) -> ContextEntry:
    _drop_exited(THREAD_CONTEXTS.entries)
    native_id = torch.ops.astr.push_backend(backend.override_name())  # raises: nothing changed
    entry = ContextEntry(backend, native_id)
    NATIVE_ENTRIES.append(None)
    THREAD_CONTEXTS.entries.append(entry)
    TASK_CONTEXTS.set(TASK_CONTEXTS.get() + (entry,))
    return entry


def pop_context(backend: AttentionBackend, entry: Optional[ContextEntry] = None) -> None:
    """Exits ``entry`` (by default the calling task's innermost open context of ``backend``):
    removes it from the task's contexts and from the thread's stack, wherever it is in them,
    since tasks sharing a thread exit their contexts interleaved."""
    task = TASK_CONTEXTS.get()
    if entry is None:
        entry = next((e for e in reversed(task) if e.open and e.backend is backend), None)
    if entry is None:  # entered in another task's context (a generator resumed elsewhere)
        entry = next(
            (e for e in reversed(THREAD_CONTEXTS.entries) if e.open and e.backend is backend),
            None,
        )
    if entry is None or not entry.open:
        raise RuntimeError(f"attn_backend: {backend!r} is not an open context here")
    entry.open = False
    if task and task[-1] is entry:  # the usual, innermost-first exit
        TASK_CONTEXTS.set(task[:-1])
    elif entry in task:
        TASK_CONTEXTS.set(tuple(e for e in task if e is not entry))
    else:  # exited from a task or thread that did not enter it
        entry.withdrawn = True
    on_thread = THREAD_CONTEXTS.entries
    if entry in on_thread:
        on_thread.remove(entry)
        torch.ops.astr.pop_backend(entry.native_id)
        NATIVE_ENTRIES.pop()
    # Else it was entered on another thread, which drops it from its C++ stack at its next enter
    # or exit; until then only that thread's direct torch.ops calls still see it.
    _drop_exited(THREAD_CONTEXTS.entries)


class AttentionBackend:
    """An attention implementation. Subclass it to plug in a backend written in Python: give
    ``fwd_prefill`` and ``fwd_decode`` (and ``supports_call`` if it cannot run every call), then
    use it with ``attn_backend(instance)`` or ``attention(..., backend=instance)``.

    Layout: q/k/v are ``[batch, seq_len, heads, head_dim]``; ``fwd=None`` is a training call
    (no KV cache), ``"prefill"``/``"decode"`` read and append to a paged KV cache.
    """

    #: The resolver's name for built-in backends; None for backends written in Python.
    name: Optional[str] = None

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def status_reason(cls) -> str:
        """Why the backend is unavailable, or a short note on what it runs (``info`` shows it)."""
        return ""

    def supports_call(self, q, kv_cache, attn_mask, is_causal, fwd) -> bool:
        return True

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        raise NotImplementedError

    def fwd_decode(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        raise NotImplementedError

    def forward(
        self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False, fwd=None
    ):
        method = self.fwd_decode if fwd == "decode" else self.fwd_prefill
        return method(
            q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask, is_causal=is_causal
        )

    def override_name(self) -> str:
        """What the C++ override stack records for this backend."""
        return self.name if self.name is not None else f"python:{type(self).__qualname__}"

    def __enter__(self):
        push_context(self)
        return self

    def __exit__(self, *exc_info):
        pop_context(self)
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
