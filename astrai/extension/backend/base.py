"""The AttentionBackend interface: what every backend, built-in or written in Python, offers."""

from __future__ import annotations

from typing import Optional


class AttentionBackend:
    """An attention implementation. Subclass it to plug in a backend written in Python: give
    ``fwd_prefill`` and ``fwd_decode`` (and ``supports_call`` if it cannot run every call), then
    use it with ``attn_backend(instance)`` or ``attention(..., backend=instance)``.

    Layout: q/k/v are ``[batch, seq_len, heads, head_dim]``; ``fwd=None`` is a training call
    (no KV cache), ``"prefill"``/``"decode"`` read and append to a paged KV cache.
    """

    #: The resolver's name for built-in backends; None for backends written in Python.
    name: Optional[str] = None

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def status_reason(cls) -> str:
        """Why the backend is unavailable, or a short note on what it runs (``info`` shows it)."""
        return ""

    def supports_call(self, q, kv_cache, attn_mask, is_causal, fwd) -> bool:
        return True

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        raise NotImplementedError

    def fwd_decode(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        raise NotImplementedError

    def forward(
        self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False, fwd=None
    ):
        method = self.fwd_decode if fwd == "decode" else self.fwd_prefill
        return method(
            q, k, v, kv_cache=kv_cache, layer_id=layer_id, attn_mask=attn_mask, is_causal=is_causal
        )

    def override_name(self) -> str:
        """What the C++ override stack records for this backend."""
        return self.name if self.name is not None else f"python:{type(self).__qualname__}"

    # ``with backend:`` is ``attn_backend(backend)``: the same code, one context per backend.
    def __enter__(self):
        from ..selection import context_of  # (that module imports this one)

        return context_of(self).__enter__()

    def __exit__(self, *exc_info):
        from ..selection import context_of

        return context_of(self).__exit__(*exc_info)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
