"""Which backend runs a call, on the Python side: the per-call ``backend=``, the ``attn_backend``
contexts, ``ASTR_BACKEND`` and the default, observed once per call and handed to the op.

README.md ("Which backend runs a call", "Contexts, threads and asyncio tasks") states the rules;
the C++ resolver (csrc/dispatch/resolver.cpp) applies them to the call. All Python state is here:

=====================  ============================  ============================================
state                  who writes it                 who reads it
=====================  ============================  ============================================
TASK_CONTEXTS          attn_backend enter and exit   eager calls through the API (``attention``,
                                                     ``explain``, ``get_backend``): ``observe``
THREAD_CONTEXTS        attn_backend enter and exit   compiled calls through the API (``observe``
                                                     while dynamo traces); enter and exit
C++ override stack     attn_backend enter and exit   direct ``torch.ops.astr.*`` calls that pass
                       (push_backend, pop_backend)   no selection, and ``check_trace_state`` in
                                                     their compiled graphs
attn_backend._entries  attn_backend enter and exit   an exit from a task or thread that did not
                                                     enter it
ASTR_BACKEND           the user                      ``observe`` (eager: any value; compiling:
                                                     compared with each name, so that dynamo
                                                     guards on it); C++ for direct op calls
=====================  ============================  ============================================

- ``TASK_CONTEXTS``, a contextvar: the calling asyncio task's (or thread's) contexts, innermost
  last; a task starts with those open where it was created.
- ``THREAD_CONTEXTS``, per thread: the entries entered on this thread and not yet exited, by any
  of its tasks, in the order of its C++ stack. Dynamo can guard on this list, not on a
  contextvar; enter and exit use it to pop entries that other threads exited.
- ``attn_backend._entries``: one context object's open entries, on any thread.

Nothing is process-wide: a thread that ends with a context open takes its state with it.

The Python API hands the op the selection it observed (``Selection.op_args``), so the op never
reads the thread's stack or the environment for it; only ``op_selection_args`` writes the op's
selection arguments and only ``parse_selected_backend`` reads ``selected_backend()``'s answer.
"""

from __future__ import annotations

import contextvars
import enum
import os
import threading
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from .backend.base import AttentionBackend
from .backend.builtin import BuiltinBackend
from .backend.factory import AttentionBackendFactory, _instance
from .backend.registry import ATTN_BACKEND, BACKEND_ALIASES, BUILTIN_BACKENDS

BackendSpec = Union[str, ATTN_BACKEND, AttentionBackend, type, None]


class BackendSource(enum.IntEnum):
    """Where a call's choice of backend came from, numbered as the op's ``backend_source``."""

    NOT_GIVEN = 0  # the op reads the thread's override stack and ASTR_BACKEND itself
    ARGUMENT = 1  # the per-call backend= (strict)
    CONTEXT = 2  # an attn_backend(...) context (strict)
    ENVIRONMENT = 3  # ASTR_BACKEND (falls back; an unknown name warns once and is ignored)
    DEFAULT = 4  # the caller saw no context and no ASTR_BACKEND: default priority


def op_selection_args(source: BackendSource, name: Optional[str]) -> dict:
    """The op's selection arguments (``torch.ops.astr.attention``, ``.lse``, ``explain``) for a
    choice of ``name`` from ``source``: ``backend`` and ``backend_source`` (a ``BackendSource``
    number), those not at the schema's default. The one place that writes them."""
    if source is BackendSource.NOT_GIVEN:
        return {}
    if source is BackendSource.DEFAULT:
        return {"backend_source": int(source)}
    return {"backend": name, "backend_source": int(source)}


def parse_selected_backend(answer: Tuple[str, int]) -> Tuple[Optional[str], BackendSource]:
    """``torch.ops.astr.selected_backend()``'s answer, (name, ``BackendSource`` number), as
    (name or None, source): the calling thread's innermost context or ASTR_BACKEND, else
    (None, DEFAULT). The one place that reads it."""
    name, source = answer
    return (name or None), BackendSource(source)


def thread_selection() -> Tuple[Optional[str], BackendSource]:
    """What a direct ``torch.ops.astr`` call on this thread would select: its innermost context
    on the C++ stack, else ASTR_BACKEND (an unknown name warns once), else (None, DEFAULT)."""
    return parse_selected_backend(torch.ops.astr.selected_backend())


class Selection(NamedTuple):
    """One call's choice as observed in Python (``observe``)."""

    source: BackendSource
    name: Optional[str]  # a built-in name, "python:LABEL", ASTR_BACKEND's value, or None
    backend: Optional[AttentionBackend]  # the chosen object (argument or context), else None
    python_backend: Optional[AttentionBackend]  # ``backend`` when written in Python: run here
    op_args: dict  # the op's selection arguments (op_selection_args)


def _selection(
    source: BackendSource, name: Optional[str], backend: Optional[AttentionBackend] = None
) -> Selection:
    written_in_python = backend is not None and not isinstance(backend, BuiltinBackend)
    return Selection(
        source,
        name,
        backend,
        backend if written_in_python else None,
        op_selection_args(source, name),
    )


DEFAULT_SELECTION = _selection(BackendSource.DEFAULT, None)


def as_backend(spec: BackendSpec) -> AttentionBackend:
    """The backend a spec names: an instance as it is, a name or ATTN_BACKEND member through
    the factory, a class as its shared instance."""
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


# -- contexts --------------------------------------------------------------------------------


class ContextEntry:
    """One entry of an ``attn_backend`` object: its selection, its id on the C++ stack of the
    thread that entered it, and whether it is still on that stack (``open``). An exit from a task
    or thread other than the entering one cannot reach the entering task's view, so it marks the
    entry ``withdrawn``, and every view skips it."""

    __slots__ = ("context", "selection", "native_id", "open", "withdrawn")

    def __init__(self, context: attn_backend, native_id: int):
        self.context = context
        self.selection = context.selection
        self.native_id = native_id
        self.open = True
        self.withdrawn = False


# The contexts of the calling task (or thread, outside asyncio), innermost last. A tuple: an
# asyncio task copies the contexts open where it was created and keeps them even after its
# creator exits them (contextvars' semantics). Readers skip withdrawn entries.
TASK_CONTEXTS: contextvars.ContextVar[Tuple[ContextEntry, ...]] = contextvars.ContextVar(
    "astrai_attn_backend_contexts", default=()
)


class _ThreadContexts(threading.local):
    """This thread's open entries, in the order of its C++ stack (whichever task entered them)."""

    def __init__(self):
        self.entries: List[ContextEntry] = []


THREAD_CONTEXTS = _ThreadContexts()


def task_context() -> Optional[ContextEntry]:
    """The innermost context of the calling task."""
    entries = TASK_CONTEXTS.get()
    for index in range(len(entries) - 1, -1, -1):  # usually returns at once
        if not entries[index].withdrawn:
            return entries[index]
    return None


def thread_context() -> Optional[ContextEntry]:
    """The innermost context entered on this thread by any task and not yet exited."""
    entries = THREAD_CONTEXTS.entries
    for index in range(len(entries) - 1, -1, -1):  # usually returns at once
        if entries[index].open:  # one exited on another thread waits here to be dropped
            return entries[index]
    return None


def task_backends() -> List[AttentionBackend]:
    """The backends of the calling task's contexts, outermost first: what code that runs the
    task's work on another thread enters again there."""
    return [entry.selection.backend for entry in TASK_CONTEXTS.get() if not entry.withdrawn]


def _drop_exited(entries: List[ContextEntry]) -> None:
    """Removes the entries exited on other threads from this thread's mirror and C++ stack."""
    if all(e.open for e in entries):
        return
    for entry in [e for e in entries if not e.open]:
        entries.remove(entry)
        torch.ops.astr.pop_backend(entry.native_id)


def _enter(context: attn_backend) -> None:
    on_thread = THREAD_CONTEXTS.entries
    _drop_exited(on_thread)
    native_id = torch.ops.astr.push_backend(context.selection.name)  # raises: nothing changed
    entry = ContextEntry(context, native_id)
    on_thread.append(entry)
    context._entries.append(entry)
    TASK_CONTEXTS.set(TASK_CONTEXTS.get() + (entry,))


def _entry_to_exit(context: attn_backend, task, on_thread) -> Optional[ContextEntry]:
    """The entry of ``context`` that an exit here closes: the calling task's innermost one, else
    this thread's (a generator resumed in another task), else the last one entered anywhere (an
    exit from another thread)."""
    for entry in reversed(task):  # usually its last
        if entry.context is context and entry.open:
            return entry
    for entry in reversed(on_thread):
        if entry.context is context and entry.open:
            return entry
    try:
        return context._entries[-1]
    except IndexError:  # none open (or another thread exited the last one meanwhile)
        return None


def _exit(context: attn_backend) -> None:
    """Closes one entry of ``context`` (``_entry_to_exit``), wherever it is in the task's and the
    thread's contexts: tasks sharing a thread exit their contexts interleaved."""
    task = TASK_CONTEXTS.get()
    on_thread = THREAD_CONTEXTS.entries
    entry = _entry_to_exit(context, task, on_thread)
    if entry is None or not entry.open:
        raise RuntimeError(f"attn_backend: {context.backend!r} is not an open context here")
    entry.open = False
    context._entries.remove(entry)
    if task and task[-1] is entry:  # the usual, innermost-first exit
        TASK_CONTEXTS.set(task[:-1])
    elif entry in task:
        TASK_CONTEXTS.set(tuple(e for e in task if e is not entry))
    else:  # exited from a task or thread that did not enter it
        entry.withdrawn = True
    if entry in on_thread:
        on_thread.remove(entry)
        torch.ops.astr.pop_backend(entry.native_id)
    # Else it was entered on another thread, which drops it from its C++ stack at its next enter
    # or exit; until then only that thread's direct torch.ops calls still see it.
    _drop_exited(on_thread)


class attn_backend:
    """Select a backend for the calls made inside the ``with`` block. Strict: a call it cannot
    run raises, naming every backend and why it was rejected.

    Task-local for calls through the Python API (``attention``, ``explain``, ``get_backend``): a
    thread sees only its own contexts, and an asyncio task only its own and those open where it
    was created. Compiled code and direct ``torch.ops.astr`` calls see the thread's innermost
    open context, whichever task entered it (torch.compile cannot guard on a contextvar). One
    object may be entered by several threads or tasks at once, and nested: each exit removes the
    exiting task's own entry, in whatever order contexts are exited. A backend object's own
    ``with backend:`` is this, with one ``attn_backend`` per backend object."""

    def __init__(self, backend: BackendSpec):
        self.backend = as_backend(backend)
        self.selection = _selection(
            BackendSource.CONTEXT, self.backend.override_name(), self.backend
        )
        self._entries: List[ContextEntry] = []  # open, in the order entered (any thread)

    def __enter__(self) -> AttentionBackend:
        _enter(self)
        return self.backend

    def __exit__(self, *exc_info):
        _exit(self)
        return False


def context_of(backend: AttentionBackend) -> attn_backend:
    """The ``attn_backend`` that ``with backend:`` enters: one per backend object, made once."""
    state = backend.__dict__
    context = state.get("_astrai_context")
    if context is None:  # setdefault: two threads entering at once share the one that lands
        context = state.setdefault("_astrai_context", attn_backend(backend))
    return context


# -- what a call observes ----------------------------------------------------------------------

# Bound once: observe runs on every call, where each attribute lookup shows.
_is_compiling = torch.compiler.is_compiling
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_task_contexts = TASK_CONTEXTS.get

# os.environ's backing dict: torch.compile guards on reads of a plain dict, not on
# os.environ.get, so a change of ASTR_BACKEND recompiles instead of reusing a stale graph.
_ENVIRONMENT = getattr(os.environ, "_data", os.environ)
_ENV_KEY = (
    b"ASTR_BACKEND" if _ENVIRONMENT is not os.environ and os.name == "posix" else "ASTR_BACKEND"
)
# (ASTR_BACKEND's value as _ENVIRONMENT holds it, its selection), per built-in backend name and
# other name ("sdpa" selects torch_native).
_ENVIRONMENT_SELECTIONS = tuple(
    (
        value.encode() if isinstance(_ENV_KEY, bytes) else value,
        _selection(BackendSource.ENVIRONMENT, name),
    )
    for value, name in [(cls.name, cls.name) for cls in BUILTIN_BACKENDS]
    + list(BACKEND_ALIASES.items())
)


def _environment_selection() -> Selection:
    value = _ENVIRONMENT.get(_ENV_KEY)
    if not value:
        return DEFAULT_SELECTION
    for choice, selection in _ENVIRONMENT_SELECTIONS:  # comparing makes dynamo guard on the value
        if value == choice:
            return selection
    if _is_compiling():  # traced as no choice; the eager call warns about it
        return DEFAULT_SELECTION
    # Not a backend: the op warns once, naming the valid ones, and ignores it.
    name = value.decode(errors="replace") if isinstance(value, bytes) else value
    return _selection(BackendSource.ENVIRONMENT, name)


def _argument_selection(backend: AttentionBackend) -> Selection:
    """``backend=backend`` as a Selection: made once per backend object in eager code."""
    if _is_compiling():
        return _selection(BackendSource.ARGUMENT, backend.override_name(), backend)
    state = backend.__dict__
    selection = state.get("_astrai_argument_selection")
    if selection is None:
        selection = _selection(BackendSource.ARGUMENT, backend.override_name(), backend)
        state["_astrai_argument_selection"] = selection
    return selection


def observe(backend: BackendSpec = None) -> Selection:
    """The selection of a call through the Python API, resolving ``backend`` (a spec) once: the
    argument; else the innermost context (of the calling task; of the thread while dynamo
    traces, as it cannot read a contextvar and can guard on the thread's list); else
    ASTR_BACKEND; else the default."""
    if backend is not None:
        return _argument_selection(as_backend(backend))
    if _is_dynamo_compiling():
        entry = thread_context()
    else:  # (task_context, inlined where nothing was withdrawn: this runs on every call)
        entries = _task_contexts()
        entry = entries[-1] if entries else None
        if entry is not None and entry.withdrawn:
            entry = task_context()
    if entry is not None:
        return entry.selection
    return _environment_selection()


_BUILTIN_NAMES = frozenset(cls.name for cls in BUILTIN_BACKENDS)


def get_backend(use_default: bool = True) -> Optional[AttentionBackend]:
    """The selected backend: the innermost ``attn_backend`` context, else ASTR_BACKEND when it
    names a backend that can run here, else (when ``use_default``) the first available backend
    in priority order. An ASTR_BACKEND that cannot run here (e.g. ``cuda`` without a GPU) is
    skipped, as calls skip it."""
    selection = observe()
    if selection.backend is not None:
        return selection.backend
    if selection.source is BackendSource.ENVIRONMENT and selection.name in _BUILTIN_NAMES:
        backend = AttentionBackendFactory.create(selection.name)
        if backend.available():
            return backend
    if not use_default:
        return None
    # The default order is built beside flash_attn_available, the hook that the backend
    # contract (tests/extension/test_backend.py) replaces; that module imports this one.
    from .backend.attention import _priority_backends

    return _priority_backends()[0]
