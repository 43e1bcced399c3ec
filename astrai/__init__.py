"""astrai: one attention entry point for PyTorch models.

from astrai import attention, attn_backend, explain, PagedKVCache, merge_states

The API lives in ``astrai.extension``, whose names this package exports (one list:
``astrai.extension.__all__``); importing ``astrai`` loads the native library.
"""

from . import extension as _extension
from .extension import *  # noqa: F403  (the same objects, under the same names)

__all__ = list(_extension.__all__)
