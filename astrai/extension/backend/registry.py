"""The one list of built-in backends in Python, in default priority order (cuda > flash >
torch_native), mirroring the C++ list (csrc/dispatch/call_description.h: ASTR_BACKENDS). The
registry of names, the ATTN_BACKEND enum, the default priority and ``info``'s rows all derive
from it; the backends' other names ("sdpa" for torch_native) come from the C++ list itself."""

from __future__ import annotations

import enum
from typing import Dict

from .. import ops
from .cuda import CudaBackend
from .flash import FlashAttnBackend
from .torch_native import TorchNativeBackend

BUILTIN_BACKENDS = (CudaBackend, FlashAttnBackend, TorchNativeBackend)

# Another name -> the backend's name: {"sdpa": "torch_native"}, as the library's list has them.
BACKEND_ALIASES: Dict[str, str] = {
    alias: name for name, aliases in ops.BUILD_INFO["backends"].items() for alias in aliases
}

# ATTN_BACKEND.CUDA == "cuda", ...: a str enum of the built-in names.
ATTN_BACKEND = enum.Enum(
    "ATTN_BACKEND", {cls.name.upper(): cls.name for cls in BUILTIN_BACKENDS}, type=str
)
ATTN_BACKEND.__module__ = __name__
