"""Which backend (and, on the cuda backend, which kernel form) runs a call, where production users
look: the ``astrai`` logger and torch.profiler.

- ``logging.getLogger("astrai")`` logs one INFO line per distinct call form (which arguments are
  given, tensors by dtype, device and rank, q's heads and head dim, options by value; sizes and
  scalar values left out), for the first call of that form:
  ``astrai: attention dense training float16 cuda q[*,*,32,128] is_causal -> flash (default)``.
  ``ASTR_LOGLEVEL=INFO`` (any ``logging`` level name) sets the logger's level and gives it a
  handler on stderr; without it, your logging configuration decides (``logging.getLogger(
  "astrai").setLevel(logging.INFO)`` with a handler of yours).
- While a profiler runs (``torch.profiler.profile``), each call runs inside a range named after
  the choice: ``astr::attention[torch_native]``, ``astr::attention[cuda:decode/split x13]``.

Nothing here runs unless one of the two is on: a call pays one check of each (``enabled``). The
choice is asked of the op's own ``explain`` and, for cuda, of ``astr::cuda_paged_plan``, once
per form (per form and shape for cuda's kernel, whose split count follows the shape).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Dict, Tuple

import torch
import torch.autograd.profiler as _profiler

logger = logging.getLogger("astrai")

_LEVEL_VARIABLE = "ASTR_LOGLEVEL"


def _configure_from_environment() -> None:
    value = os.environ.get(_LEVEL_VARIABLE, "").strip()
    if not value:
        return
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(
            f"{_LEVEL_VARIABLE}={value!r}: expected a logging level (DEBUG, INFO, WARNING, "
            "ERROR, CRITICAL)"
        )
    logger.setLevel(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # the variable asked for stderr: not twice through the root's


_configure_from_environment()

_INFO = logging.INFO
_is_enabled_for = logger.isEnabledFor
_is_compiling = torch.compiler.is_compiling


def enabled() -> bool:
    """Whether a call must be made visible: the logger takes INFO, or a profiler runs. The one
    check on the hot path (whether torch.compile traces, then an attribute read and the logger's
    cached level test). Compiled code is never observed (its trace would break on logging)."""
    return not _is_compiling() and (_profiler._is_profiler_enabled or _is_enabled_for(_INFO))


# The op's arguments whose values are part of a call's form (the others: given or not).
_FORM_VALUES = ("is_causal", "mode", "backend", "backend_source", "return_lse")


def call_form(args: dict) -> tuple:
    """A call's form: hashable, without sizes or scalar values."""
    form = []
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            entry = (name, value.dtype, value.device.type, value.dim())
            if name == "q":
                entry += tuple(value.shape[-2:])  # heads and head dim choose kernels
            form.append(entry)
        elif name in _FORM_VALUES:
            form.append((name, value))
        else:
            form.append((name,))
    return tuple(form)


def describe_form(args: dict) -> str:
    """The form in words, for the log line."""
    q = args["q"]
    paged = "k_cache" in args
    kind = (
        f"paged {args.get('mode', 'prefill')}"
        if paged
        else f"dense {args.get('mode') or 'training'}"
    )
    words = [kind, str(q.dtype).replace("torch.", ""), q.device.type]
    dims = ",".join(["*"] * (q.dim() - 2) + [str(d) for d in q.shape[-2:]])
    words.append(f"q[{dims}]")
    if paged:
        words.append(f"cache {str(args['k_cache'].dtype).replace('torch.', '')}")
    for name, value in args.items():
        if name in (
            "q",
            "k",
            "v",
            "k_cache",
            "v_cache",
            "block_table",
            "seq_lens",
            "query_start_loc",
            "max_query_len",
            "mode",
            "backend",
            "backend_source",
        ):
            continue
        if value is True or (value is not False and value is not None):
            words.append(name)
    return " ".join(words)


_CHOICES: Dict[tuple, Tuple[str, str]] = {}  # form -> (backend, its source), logged once
_KERNELS: Dict[tuple, str] = {}  # (form, shapes) -> cuda kernel form


def _choice(args: dict, form: tuple) -> Tuple[str, str]:
    choice = _CHOICES.get(form)
    if choice is not None:
        return choice
    decision = json.loads(torch.ops.astr.explain(**args))
    backend = decision["backend"] or "none"
    source = decision["source"] + (", fell back" if decision["fell_back"] else "")
    choice = _CHOICES[form] = (backend, source)
    if _is_enabled_for(_INFO):
        label = backend
        if backend == "cuda":
            label += ":" + _kernel(args, form)
        logger.info("attention %s -> %s (%s)", describe_form(args), label, source)
    return choice


def _kernel(args: dict, form: tuple) -> str:
    key = (form, tuple(tuple(t.shape) for t in args.values() if isinstance(t, torch.Tensor)))
    kernel = _KERNELS.get(key)
    if kernel is None:
        plan_args = {name: value for name, value in args.items() if name != "return_lse"}
        kernel = _KERNELS[key] = torch.ops.astr.cuda_paged_plan(**plan_args)
    return kernel


def range_name(args: dict) -> str:
    """The profiler range of this call: ``astr::attention[backend]``, with the kernel form on
    cuda (``astr::attention[cuda:prefill/warp_specialized]``)."""
    form = call_form(args)
    backend, _ = _choice(args, form)
    if backend == "cuda":
        return f"astr::attention[cuda:{_kernel(args, form)}]"
    return f"astr::attention[{backend}]"


def run_visibly(op, args: dict):
    """``op(**args)`` with its choice logged once per form and, under a profiler, inside a
    range named after it. A call the op refuses raises from the op, as it would unobserved."""
    try:
        name = range_name(args)
    except Exception:  # explain refuses the call: the op raises its own error (not swallowed)
        return op(**args)
    if not _profiler._is_profiler_enabled:
        return op(**args)
    with torch.profiler.record_function(name):
        return op(**args)
