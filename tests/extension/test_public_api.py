"""The public API is importable from ``astrai`` itself; ``astrai.extension`` exports the same
objects, and the module paths that the backend contract uses keep working."""

from __future__ import annotations

import importlib

import astrai
import astrai.extension


def test_the_api_imports_from_astrai():
    from astrai import (  # noqa: F401
        ATTN_BACKEND,
        KVCacheFullError,
        PagedKVCache,
        attention,
        attn_backend,
        explain,
        get_backend,
        merge_states,
    )


def test_astrai_exports_what_astrai_extension_exports_the_same_objects():
    assert sorted(astrai.__all__) == sorted(astrai.extension.__all__)
    for name in astrai.extension.__all__:
        assert getattr(astrai, name) is getattr(astrai.extension, name), name


def test_the_api_module_path_of_the_backend_contract_keeps_its_names():
    module = importlib.import_module("astrai.extension.backend.attention")
    for name in ("flash_attn_available", "_priority_backends", "_instance", "FlashAttnBackend"):
        assert hasattr(module, name), name
    assert module.attention is astrai.attention
    assert module.attn_backend is astrai.attn_backend
    assert module.get_backend is astrai.get_backend
