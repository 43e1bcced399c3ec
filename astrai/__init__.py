"""astrai: one attention entry point for PyTorch models.

from astrai import attention, attn_backend, explain, PagedKVCache, merge_states

The API lives in ``astrai.extension`` (which exports the same objects); importing ``astrai``
loads the native library.
"""

from .extension import (
    ATTN_BACKEND,
    AttentionBackend,
    AttentionBackendFactory,
    CudaBackend,
    Decision,
    FlashAttnBackend,
    KVCacheFullError,
    PagedKVCache,
    StepMetadata,
    TorchNativeBackend,
    attention,
    attn_backend,
    explain,
    get_backend,
    merge_states,
)

__all__ = [
    "ATTN_BACKEND",
    "AttentionBackend",
    "AttentionBackendFactory",
    "CudaBackend",
    "Decision",
    "FlashAttnBackend",
    "KVCacheFullError",
    "PagedKVCache",
    "StepMetadata",
    "TorchNativeBackend",
    "attention",
    "attn_backend",
    "explain",
    "get_backend",
    "merge_states",
]
