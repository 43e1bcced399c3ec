"""The one list of built-in backends in Python, in default priority order (cuda > flash >
torch_native), mirroring the C++ list (csrc/dispatch/call_description.h: ASTR_BACKENDS). The
registry of names, the ATTN_BACKEND enum, the default priority and ``info``'s rows all derive
from it."""

from __future__ import annotations

import enum

from .cuda import CudaBackend
from .flash import FlashAttnBackend
from .torch_native import TorchNativeBackend

BUILTIN_BACKENDS = (CudaBackend, FlashAttnBackend, TorchNativeBackend)

# ATTN_BACKEND.CUDA == "cuda", ...: a str enum of the built-in names.
ATTN_BACKEND = enum.Enum(
    "ATTN_BACKEND", {cls.name.upper(): cls.name for cls in BUILTIN_BACKENDS}, type=str
)
ATTN_BACKEND.__module__ = __name__
