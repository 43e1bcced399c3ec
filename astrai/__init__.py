"""astrai: one attention entry point for PyTorch models.

from astrai import attention, attn_backend, explain, PagedKVCache, merge_states
astrai.__version__  # "0.2.0"; the installed wheel's version adds its torch and CUDA

The API lives in ``astrai.extension``, whose names this package exports (one list:
``astrai.extension.__all__``). They load on first use: ``import astrai`` alone imports neither
torch nor the native library (so that ``python -m astrai.demo --help`` answers at once); the
first name taken from it (``astrai.attention``, ``from astrai import PagedKVCache``) loads both.
"""

import importlib

from ._version import __version__  # noqa: F401  (the package's version)


def _extension():
    # import_module, not "from . import extension": that form asks this module for the name
    # first, which lands in __getattr__ again.
    return importlib.import_module(__name__ + ".extension")


def __getattr__(name: str):
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'astrai' has no attribute {name!r}")
    extension = _extension()
    if name == "__all__":
        return list(extension.__all__)
    if name == "extension":
        return extension
    if name not in extension.__all__:
        raise AttributeError(f"module 'astrai' has no attribute {name!r}")
    value = getattr(extension, name)
    globals()[name] = value  # the same object, found directly from now on
    return value


def __dir__():
    return sorted(set(globals()) | set(_extension().__all__))
