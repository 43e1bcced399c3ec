"""astrai's warnings: one category, ``AstraiWarning`` (a ``UserWarning``), attributed to the line
of the caller's code that called into astrai, whichever astrai and torch frames lie between (the
native library's warnings come through ``warn``, from csrc/python_warnings.cpp).

    warnings.filterwarnings("error", category=AstraiWarning)  # e.g. fail on any fallback
"""

from __future__ import annotations

import os
import sys
import warnings

import torch


class AstraiWarning(UserWarning):
    """A warning from astrai: an implicit backend fallback, an ASTR_BACKEND that names no
    backend, and the like."""


# Frames in these folders are astrai's or torch's (the op's __call__): never the caller's line.
_ASTRAI_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_FOLDER = os.path.dirname(os.path.abspath(torch.__file__))
_INTERNAL_FOLDERS = (_ASTRAI_FOLDER + os.sep, _TORCH_FOLDER + os.sep)


def warn(message: str) -> None:
    """Issue ``message`` as an AstraiWarning attributed to the nearest frame outside astrai and
    torch. Under a filter that turns it into an error, raises it (the native caller then raises
    a RuntimeError with the same text)."""
    frame = sys._getframe(0).f_back
    level = 2  # warnings.warn's stacklevel of this function's caller
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, AstraiWarning, stacklevel=level)


def _is_internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_INTERNAL_FOLDERS)
