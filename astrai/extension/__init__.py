"""astrai.extension: one attention entry point over our CUDA kernels, flash-attn and SDPA
(``astrai`` re-exports all of it).

from astrai import attention, attn_backend, PagedKVCache
out = attention(q, k, v, is_causal=True)            # training / dense, BLHD
with attn_backend("torch_native"):                   # strict choice, this thread or task only
    out = attention(q, k, v, kv_cache=cache, layer_id=0, fwd="decode")
"""

from . import ops  # noqa: F401  (loads the native library and registers fake kernels)
from .backend.attention import (
    ATTN_BACKEND,
    AttentionBackend,
    AttentionBackendFactory,
    CudaBackend,
    Decision,
    FlashAttnBackend,
    TorchNativeBackend,
    attention,
    explain,
    merge_states,
)
from .kv_cache import KVCacheFullError, PagedKVCache, StepMetadata, tokens_that_fit
from .latent_cache import PagedLatentCache
from .mla import explain_mla, mla_attention
from .ops import batch_invariant, set_batch_invariant
from .selection import attn_backend, get_backend
from .warning import AstraiWarning

__all__ = [
    "ATTN_BACKEND",
    "AstraiWarning",
    "AttentionBackend",
    "AttentionBackendFactory",
    "CudaBackend",
    "Decision",
    "FlashAttnBackend",
    "KVCacheFullError",
    "PagedKVCache",
    "PagedLatentCache",
    "StepMetadata",
    "TorchNativeBackend",
    "attention",
    "attn_backend",
    "batch_invariant",
    "explain",
    "explain_mla",
    "get_backend",
    "merge_states",
    "mla_attention",
    "tokens_that_fit",
    "set_batch_invariant",
]
