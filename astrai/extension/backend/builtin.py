"""What the three built-in backends share: their rules and their runs live in C++; these
classes only name the backend to the resolver."""

from __future__ import annotations

from typing import List, Optional

import torch

from .base import AttentionBackend


def _form_args(q, kv_cache):
    """q as a paged call's [T, Hq, D] and the first layer's pools (their kv heads and head
    dims: v's may differ from q/k's)."""
    k_cache = kv_cache.k_pools[0] if kv_cache is not None else None
    v_cache = kv_cache.v_pools[0] if kv_cache is not None else None
    if k_cache is not None and q.dim() == 4:
        q = q.reshape(-1, q.shape[-2], q.shape[-1])
    return q, k_cache, v_cache


class BuiltinBackend(AttentionBackend):
    name: str = ""

    def rejection_reasons(
        self, q, kv_cache=None, attn_mask=None, is_causal=False, fwd=None, placement=False
    ) -> List[str]:
        """Why this backend cannot run a call of this form (empty when it can), as the C++
        resolver sees it. ``placement`` adds availability, device and GPU-arch rules."""
        q, k_cache, v_cache = _form_args(q, kv_cache)
        mode = fwd if fwd is not None else ("prefill" if kv_cache is not None else None)
        text = torch.ops.astr.check_backend(
            self.name, q, k_cache, attn_mask, is_causal, mode, placement, v_cache
        )
        return [line for line in text.split("\n") if line]

    def supports_call(self, q, kv_cache, attn_mask, is_causal, fwd) -> bool:
        """Whether this backend can run a call of this form (dtype, head dim, cache, page
        size, mask, mode, gradients), assuming it is available on the call's device."""
        return not self.rejection_reasons(q, kv_cache, attn_mask, is_causal, fwd)

    def fwd_prefill(
        self,
        q,
        k,
        v,
        kv_cache=None,
        layer_id=0,
        attn_mask=None,
        is_causal=False,
        scale: Optional[float] = None,
    ):
        fwd = "prefill" if kv_cache is not None else None
        return self._attention(q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd, scale)

    def fwd_decode(
        self,
        q,
        k,
        v,
        kv_cache=None,
        layer_id=0,
        attn_mask=None,
        is_causal=False,
        scale: Optional[float] = None,
    ):
        return self._attention(q, k, v, kv_cache, layer_id, attn_mask, is_causal, "decode", scale)

    def _attention(self, q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd, scale):
        """``attention(..., backend=self)``: a call run on this backend, strictly."""
        from .attention import attention  # (that module imports this one)

        return attention(
            q, k, v, kv_cache, layer_id, attn_mask, is_causal, fwd, backend=self, scale=scale
        )
