"""A paged latent cache for latent attention (``mla_attention``): per layer, each token's latent
``ckv`` (``latent_dim`` values, 512 in DeepSeek-family models) and rotary key ``krope``
(``rope_dim``, 64), shared by every head: about 70 times fewer bytes per token than the same
model's decompressed K and V.

Pool layout: ``ckv_pools[layer]`` ``[num_pages, page_size, latent_dim]`` and
``krope_pools[layer]`` ``[num_pages, page_size, rope_dim]``; token ``i`` of a sequence is at slot
``i % page_size`` of page ``block_table[b, i // page_size]``, as in ``PagedKVCache``, whose page
allocator and step metadata this cache uses (``begin_step``, ``free``, ``seq_len``,
``pages_of``, ``step``: the same rules, the same refusals).

An FP8 latent (``latent_dtype=torch.float8_e4m3fn``) keeps one byte per latent value and a
float32 ``[1]`` scale per layer (``ckv_scales[layer]``, 1.0 at first): stored as
``fp8(clamp(x / scale, -448, 448))``, read as ``stored.float() * scale``. The rotary keys stay in
``dtype`` (their 64 values carry the position). Set the scales before the first tokens are
written (``set_scale``, or ``scale_from`` on the first prefill's latents).

Writes never carry autograd history (``astr::append_mla`` runs below autograd).
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence

import torch

from . import ops
from .kv_cache import PagedKVCache, StepMetadata, _as_count, _as_positive_count
from .mla import mla_attention
from .selection import BackendSpec

LATENT_FP8_DTYPE = torch.float8_e4m3fn


class PagedLatentCache:
    """Per-layer paged latent and rotary-key pools, with ``PagedKVCache``'s page allocator and
    step-metadata builder. Not thread-safe (as ``PagedKVCache``)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int = 512,
        rope_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        latent_dtype: Optional[torch.dtype] = None,
    ):
        num_layers = _as_positive_count("num_layers", num_layers)
        latent_dim = _as_positive_count("latent_dim", latent_dim)
        rope_dim = _as_positive_count("rope_dim", rope_dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
        if dtype.itemsize == 1:
            raise TypeError(
                f"dtype: {dtype} is the rotary keys' dtype, which stays the model's; an FP8 "
                "latent is latent_dtype=torch.float8_e4m3fn"
            )
        latent_dtype = dtype if latent_dtype is None else latent_dtype
        if latent_dtype not in (dtype, LATENT_FP8_DTYPE):
            raise TypeError(
                f"latent_dtype: expected None (the model's dtype, {dtype}) or "
                f"torch.float8_e4m3fn, got {latent_dtype!r}"
            )
        # The page allocator and step builder: a PagedKVCache whose own pools (one byte a slot:
        # one kv head of one FP8 element) are never read or written.
        self._pages = PagedKVCache(
            1, num_pages, page_size, 1, 1, dtype=torch.float8_e4m3fn, device=device
        )
        self.num_layers = num_layers
        self.num_pages = self._pages.num_pages
        self.page_size = self._pages.page_size
        self.latent_dim = latent_dim
        self.rope_dim = rope_dim
        self.dtype = dtype
        self.latent_dtype = latent_dtype
        self.device = self._pages.device
        self.ckv_pools = [
            torch.zeros(num_pages, page_size, latent_dim, dtype=latent_dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.krope_pools = [
            torch.zeros(num_pages, page_size, rope_dim, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.ckv_scales: List[torch.Tensor] = []
        if self.is_fp8:
            self.ckv_scales = [
                torch.ones(1, dtype=torch.float32, device=self.device) for _ in range(num_layers)
            ]

    # -- pages and steps: PagedKVCache's --------------------------------------------------
    @property
    def step(self) -> Optional[StepMetadata]:
        return self._pages.step

    @property
    def free_pages(self) -> int:
        return self._pages.free_pages

    def begin_step(
        self,
        seq_ids: Sequence[int],
        num_new_tokens: Sequence[int],
        block_table_width: Optional[int] = None,
    ) -> StepMetadata:
        """Reserve room for each sequence's new tokens and build the step's metadata
        (``PagedKVCache.begin_step``: a refused step changes nothing)."""
        return self._pages.begin_step(seq_ids, num_new_tokens, block_table_width)

    def free(self, seq_id) -> None:
        self._pages.free(seq_id)

    def seq_len(self, seq_id) -> int:
        return self._pages.seq_len(seq_id)

    def pages_of(self, seq_id) -> List[int]:
        return self._pages.pages_of(seq_id)

    # -- pools ---------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.latent_dtype == LATENT_FP8_DTYPE

    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer's pools (the FP8 scales aside)."""
        latent = self.latent_dim * self.latent_dtype.itemsize
        return self.num_layers * (latent + self.rope_dim * self.dtype.itemsize)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ckv_pool ``[P, S, latent_dim]``, krope_pool ``[P, S, rope_dim]``) of a layer."""
        layer_id = _as_count("layer_id", layer_id)
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer_id: {layer_id} out of range for {self.num_layers} layers")
        return self.ckv_pools[layer_id], self.krope_pools[layer_id]

    def scale(self, layer_id: int) -> Optional[torch.Tensor]:
        """A layer's FP8 latent scale (float32 ``[1]``), or None for a 16-bit latent."""
        self.layer(layer_id)
        return self.ckv_scales[operator.index(layer_id)] if self.is_fp8 else None

    def set_scale(self, layer_id: int, scale) -> None:
        """Set a layer's FP8 latent scale: a positive finite float or float32 ``[1]`` tensor,
        copied in place (a captured CUDA graph sees the new value)."""
        if not self.is_fp8:
            raise ValueError(f"set_scale: the latent is {self.latent_dtype}, not FP8")
        current = self.scale(layer_id)
        if isinstance(scale, torch.Tensor):
            scale = scale.detach()
        try:
            value = torch.as_tensor(scale, dtype=torch.float32).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"scale: expected a float or a float32 [1] tensor, got {scale!r}"
            ) from None
        host = value.cpu()
        if host.numel() != 1 or not bool(torch.isfinite(host).all()) or not bool((host > 0).all()):
            raise ValueError(f"scale: expected one positive finite value, got {host.tolist()}")
        current.copy_(value.to(current.device))

    def scale_from(self, layer_id: int, ckv: torch.Tensor) -> None:
        """Set a layer's FP8 scale from data: amax(|ckv|) / 448, e4m3's largest value (1.0 for
        all zeros). Call it on the first prefill's latents ``[..., latent_dim]``."""
        if not self.is_fp8:
            raise ValueError(f"scale_from: the latent is {self.latent_dtype}, not FP8")
        _check_rows("ckv", ckv, self.latent_dim)
        amax = ckv.detach().abs().amax().float()
        if not bool(torch.isfinite(amax)):
            raise ValueError("ckv: holds NaN or inf values; no FP8 scale fits them")
        largest = torch.finfo(LATENT_FP8_DTYPE).max
        self.set_scale(layer_id, amax / largest if float(amax) > 0 else 1.0)

    def append(self, layer_id: int, ckv: torch.Tensor, krope: torch.Tensor) -> None:
        """Write this step's new tokens' latents ``[..., latent_dim]`` and rotary keys
        ``[..., rope_dim]`` into a layer's pools."""
        step = self._require_step()
        ckv_pool, krope_pool = self.layer(layer_id)
        _check_rows("ckv", ckv, self.latent_dim)
        _check_rows("krope", krope, self.rope_dim)
        tokens = step.slot_mapping.shape[0]
        for name, tensor, dim in (("ckv", ckv, self.latent_dim), ("krope", krope, self.rope_dim)):
            if tensor.numel() // dim != tokens:
                raise ValueError(
                    f"{name}: {tensor.numel() // dim} tokens (shape {tuple(tensor.shape)}), but "
                    f"this step (begin_step) adds {tokens} new tokens"
                )
        ops.append_mla(
            ckv.reshape(-1, self.latent_dim),
            krope.reshape(-1, self.rope_dim),
            ckv_pool,
            krope_pool,
            step.slot_mapping,
            self.scale(layer_id),
        )

    def attention(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        scale: float,
        *,
        is_causal: bool = True,
        backend: BackendSpec = None,
        return_lse: bool = False,
    ):
        """``mla_attention`` of q_nope ``[T, H, latent_dim]`` and q_rope ``[T, H, rope_dim]``
        (the step's new tokens, packed) over a layer's pools, with the step's metadata."""
        step = self._require_step()
        ckv_pool, krope_pool = self.layer(layer_id)
        return mla_attention(
            q_nope,
            q_rope,
            ckv_pool,
            krope_pool,
            step.block_table,
            step.seq_lens,
            step.query_start_loc,
            step.max_query_len,
            step.mode,
            scale,
            is_causal=is_causal,
            backend=backend,
            ckv_scale=self.scale(layer_id),
            return_lse=return_lse,
        )

    def _require_step(self) -> StepMetadata:
        if self.step is None:
            raise RuntimeError("latent cache: call begin_step(...) first")
        return self.step


def _check_rows(name: str, tensor, dim: int) -> None:
    """``tensor`` holds tokens' rows of ``dim`` values: ``[..., dim]``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor [..., {dim}], got {type(tensor).__name__}")
    if tensor.dim() < 1 or tensor.shape[-1] != dim:
        raise ValueError(f"{name}: expected [..., {dim}], got shape {tuple(tensor.shape)}")
