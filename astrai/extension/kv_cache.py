"""A paged KV cache: per-layer K/V pools of fixed-size pages, pages handed to sequences as
they grow, and each step's metadata built on the host and copied to the device in one copy.

Pool layout: ``[num_pages, page_size, kv_heads, head_dim]``. A sequence's tokens live in the
pages its block-table row lists, in order; token ``i`` is at slot ``page * page_size + i %
page_size`` of page ``block_table[b, i // page_size]``.

FP8 caches (``dtype=torch.float8_e4m3fn`` or ``torch.float8_e5m2``) keep one byte per element
and a float32 scale per layer and kv head (``k_scales[layer]``, ``v_scales[layer]``, 1.0 at
first): a token is stored as ``fp8(clamp(x / scale, -max, max))`` and read as
``stored.float() * scale``. The model stays in bf16/fp16. Set the scales before the first
tokens are written (``set_scales``, or ``scales_from`` on the first prefill's k/v): a page
written under one scale is read with whatever the scale is at read time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import ops

SUPPORTED_PAGE_SIZES = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCacheFullError(RuntimeError):
    """The step needs more pages than are free; nothing was changed."""


@dataclass
class StepMetadata:
    """What one forward step over the cache needs, all on the cache's device."""

    block_table: torch.Tensor  # int32 [B, W]: pages of each sequence
    seq_lens: torch.Tensor  # int32 [B]: cached + new tokens of each sequence
    query_start_loc: torch.Tensor  # int32 [B + 1]: prefix sums of new tokens
    slot_mapping: torch.Tensor  # int32 [T]: where each new token's k/v goes
    max_query_len: int  # most new tokens of any sequence (host int: no op reads lengths back)
    mode: str  # "decode" when every sequence adds one token, else "prefill"

    _TENSORS = ("block_table", "seq_lens", "query_start_loc", "slot_mapping")

    def copy_(self, other: StepMetadata) -> StepMetadata:
        """Copy another step's metadata into these tensors in place (same shapes), so that a
        captured CUDA graph that reads these buffers sees the new step. Everything is checked
        before anything is copied: a refused step leaves these buffers as they were."""
        for name in self._TENSORS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine.shape != theirs.shape:
                raise ValueError(
                    f"{name}: shape {tuple(theirs.shape)} does not match the captured "
                    f"{tuple(mine.shape)}; build steps with the same batch and block_table_width"
                )
        if other.max_query_len > self.max_query_len:
            raise ValueError(
                f"max_query_len: {other.max_query_len} is larger than the captured step's "
                f"{self.max_query_len}"
            )
        if other.mode != self.mode:
            raise ValueError(f"mode: a {other.mode} step cannot replay a captured {self.mode} step")
        for name in self._TENSORS:
            getattr(self, name).copy_(getattr(other, name), non_blocking=True)
        return self


class PagedKVCache:
    """Per-layer paged K/V pools plus the page allocator and step-metadata builder."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        head_dim_v: Optional[int] = None,
    ):
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(
                f"page_size: {page_size} not supported (supported: {list(SUPPORTED_PAGE_SIZES)})"
            )
        if num_pages < 1 or num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
            raise ValueError("num_layers, num_pages, num_kv_heads, head_dim: must be positive")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v or head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape_k = (num_pages, page_size, num_kv_heads, head_dim)
        shape_v = (num_pages, page_size, num_kv_heads, self.head_dim_v)
        self.k_pools = [
            torch.zeros(shape_k, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_pools = [
            torch.zeros(shape_v, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        # FP8 pools: per-layer, per-kv-head dequantization scales (module docstring).
        self.k_scales: List[torch.Tensor] = []
        self.v_scales: List[torch.Tensor] = []
        if self.is_fp8:
            self.k_scales = [
                torch.ones(num_kv_heads, dtype=torch.float32, device=self.device)
                for _ in range(num_layers)
            ]
            self.v_scales = [s.clone() for s in self.k_scales]
        self._free_pages: List[int] = list(range(num_pages - 1, -1, -1))  # pop() takes page 0 first
        self._pages: Dict[int, List[int]] = {}
        self._lengths: Dict[int, int] = {}
        self.step: Optional[StepMetadata] = None
        self._step_seq_ids: frozenset = frozenset()  # the sequences self.step writes to

    # -- sequences and pages -------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def seq_len(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    def pages_of(self, seq_id: int) -> List[int]:
        return list(self._pages.get(seq_id, []))

    def free(self, seq_id: int) -> None:
        """Return a finished sequence's pages to the pool. A step that writes to the sequence
        ends with it (``step`` becomes None): its slots may soon belong to another sequence."""
        pages = self._pages.pop(seq_id, None)
        if pages is None:
            raise KeyError(f"seq_id: {seq_id} is not in the cache")
        self._lengths.pop(seq_id, None)
        self._free_pages.extend(reversed(pages))
        if seq_id in self._step_seq_ids:
            self._end_step()

    def _end_step(self) -> None:
        self.step = None
        self._step_seq_ids = frozenset()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer_id: {layer_id} out of range for {self.num_layers} layers")
        return self.k_pools[layer_id], self.v_pools[layer_id]

    # -- FP8 scales ------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    def scales(self, layer_id: int) -> tuple:
        """(k_scale, v_scale) of a layer: float32 [kv_heads] for FP8 pools, (None, None) else."""
        self.layer(layer_id)  # checks layer_id
        if not self.is_fp8:
            return None, None
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def set_scales(self, layer_id: int, k_scale, v_scale) -> None:
        """Set a layer's FP8 scales: each a positive finite float or a float32 ``[kv_heads]``
        tensor. Copied in place, so a captured CUDA graph sees the new values."""
        if not self.is_fp8:
            raise ValueError(f"set_scales: the cache holds {self.dtype}, not an FP8 dtype")
        self.layer(layer_id)
        new = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            tensor = torch.as_tensor(value, dtype=torch.float32)
            if tensor.dim() == 0:
                tensor = tensor.expand(self.num_kv_heads)
            if tuple(tensor.shape) != (self.num_kv_heads,):
                raise ValueError(
                    f"{name}: expected a float or [kv_heads={self.num_kv_heads}], got shape "
                    f"{tuple(tensor.shape)}"
                )
            host = tensor.detach().cpu()
            if not bool(torch.isfinite(host).all()) or not bool((host > 0).all()):
                raise ValueError(f"{name}: expected positive finite scales, got {host.tolist()}")
            new.append(tensor)
        self.k_scales[layer_id].copy_(new[0])
        self.v_scales[layer_id].copy_(new[1])

    def scales_from(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set a layer's FP8 scales from data, per kv head: amax / the format's largest value
        (so the largest |x| maps onto it). Call it on the first prefill's k/v
        ``[..., kv_heads, head_dim]``, before appending them; an all-zero head keeps scale 1."""
        if not self.is_fp8:
            raise ValueError(f"scales_from: the cache holds {self.dtype}, not an FP8 dtype")
        largest = torch.finfo(self.dtype).max
        scales = []
        for tensor in (k, v):
            amax = tensor.detach().reshape(-1, self.num_kv_heads, tensor.shape[-1]).abs()
            amax = amax.amax(dim=(0, 2)).float()
            scales.append(torch.where(amax > 0, amax / largest, torch.ones_like(amax)))
        self.set_scales(layer_id, scales[0], scales[1])

    # -- steps ---------------------------------------------------------------------------
    def begin_step(
        self,
        seq_ids: Sequence[int],
        num_new_tokens: Sequence[int],
        block_table_width: Optional[int] = None,
    ) -> StepMetadata:
        """Reserve room for each sequence's new tokens and build the step's metadata.

        A seq_id not yet in the cache starts a new sequence. ``block_table_width`` fixes the
        block table's width (needed when the step will be replayed by a captured CUDA graph);
        by default it is the most pages any sequence of this step uses.

        A refused step (ValueError, TypeError, or KVCacheFullError when the pool has too few
        free pages) changes no page, length or pool, and ends the previous step (``step``
        becomes None): no later call can write this step's tokens through that step's slots.
        """
        self._end_step()
        seq_ids, counts = self._check_step(seq_ids, num_new_tokens)
        page = self.page_size
        new_lengths = [self.seq_len(s) + n for s, n in zip(seq_ids, counts)]
        pages_needed = [-(-length // page) for length in new_lengths]
        extra = [
            max(0, need - len(self._pages.get(s, []))) for s, need in zip(seq_ids, pages_needed)
        ]
        if sum(extra) > len(self._free_pages):
            raise KVCacheFullError(
                f"KV cache out of pages: this step needs {sum(extra)} more pages of {page} "
                f"tokens, {len(self._free_pages)} of {self.num_pages} are free; free finished "
                f"sequences or build the cache with more pages"
            )
        width = max(pages_needed)
        if block_table_width is not None:
            block_table_width = _as_count("block_table_width", block_table_width)
            if block_table_width < width:
                raise ValueError(
                    f"block_table_width: {block_table_width} pages is fewer than the {width} "
                    f"this step needs"
                )
            width = block_table_width

        # Build everything from copies first; the allocator's state changes only at the end.
        free = list(self._free_pages)
        pages_of = {}
        for seq_id, more in zip(seq_ids, extra):
            pages_of[seq_id] = self._pages.get(seq_id, []) + [free.pop() for _ in range(more)]

        batch = len(seq_ids)
        tokens = sum(counts)
        # One host buffer: block_table | seq_lens | query_start_loc | slot_mapping.
        host = torch.zeros(batch * width + batch + (batch + 1) + tokens, dtype=torch.int32)
        table = host[: batch * width].view(batch, width)
        lens = host[batch * width : batch * width + batch]
        starts = host[batch * width + batch : batch * width + 2 * batch + 1]
        slots = host[batch * width + 2 * batch + 1 :]
        cursor = 0
        for b, (seq_id, new) in enumerate(zip(seq_ids, counts)):
            pages = pages_of[seq_id]
            table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            old = self.seq_len(seq_id)
            positions = torch.arange(old, old + new)
            page_ids = torch.tensor(pages, dtype=torch.int64)[positions // page]
            slots[cursor : cursor + new] = (page_ids * page + positions % page).to(torch.int32)
            lens[b] = old + new
            starts[b + 1] = starts[b] + new
            cursor += new

        if self.device.type == "cuda":
            host = host.pin_memory()
        device = host.to(self.device, non_blocking=True)
        step = StepMetadata(
            block_table=device[: batch * width].view(batch, width),
            seq_lens=device[batch * width : batch * width + batch],
            query_start_loc=device[batch * width + batch : batch * width + 2 * batch + 1],
            slot_mapping=device[batch * width + 2 * batch + 1 :],
            max_query_len=max(counts),
            mode="decode" if all(n == 1 for n in counts) else "prefill",
        )

        self._free_pages = free
        for seq_id, length in zip(seq_ids, new_lengths):
            self._pages[seq_id] = pages_of[seq_id]
            self._lengths[seq_id] = length
        self.step = step
        self._step_seq_ids = frozenset(seq_ids)
        return step

    def _check_step(self, seq_ids, num_new_tokens) -> Tuple[list, List[int]]:
        """The ids as a list and the new-token counts as ints, after checking both; raises,
        changing nothing."""
        try:
            seq_ids, num_new_tokens = list(seq_ids), list(num_new_tokens)
        except TypeError:
            raise TypeError("seq_ids, num_new_tokens: expected two sequences") from None
        if len(seq_ids) != len(num_new_tokens) or not seq_ids:
            raise ValueError("seq_ids, num_new_tokens: expected two non-empty lists of one length")
        try:
            if len(set(seq_ids)) != len(seq_ids):
                raise ValueError("seq_ids: a sequence appears twice in one step")
        except TypeError:
            raise TypeError(f"seq_ids: expected hashable ids, got {seq_ids!r}") from None
        counts = [_as_count("num_new_tokens", n) for n in num_new_tokens]
        if any(n < 1 for n in counts):
            raise ValueError("num_new_tokens: every sequence must add at least one token")
        return seq_ids, counts

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's new tokens' k/v ``[..., kv_heads, head_dim]`` into a layer's pools."""
        if self.step is None:
            raise RuntimeError("kv_cache: call begin_step(...) before appending")
        k_pool, v_pool = self.layer(layer_id)
        for name, tensor, dim in (("k", k, self.head_dim), ("v", v, self.head_dim_v)):
            if tensor.dim() < 2 or tuple(tensor.shape[-2:]) != (self.num_kv_heads, dim):
                raise ValueError(
                    f"{name}: expected [..., kv_heads={self.num_kv_heads}, head_dim={dim}], "
                    f"got shape {tuple(tensor.shape)}"
                )
        step_tokens = self.step.slot_mapping.shape[0]
        for name, tensor in (("k", k), ("v", v)):
            tokens = tensor.numel() // (tensor.shape[-2] * tensor.shape[-1] or 1)
            if tokens != step_tokens:
                raise ValueError(
                    f"{name}: {tokens} tokens (shape {tuple(tensor.shape)}), but this step "
                    f"(begin_step) adds {step_tokens} new tokens"
                )
        k_scale, v_scale = self.scales(layer_id)
        ops.append_kv(
            k.reshape(-1, self.num_kv_heads, self.head_dim),
            v.reshape(-1, self.num_kv_heads, self.head_dim_v),
            k_pool,
            v_pool,
            self.step.slot_mapping,
            k_scale,
            v_scale,
        )


def tokens_that_fit(
    memory_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    head_dim_v: Optional[int] = None,
) -> int:
    """How many tokens' K and V (every layer) a cache of ``memory_bytes`` holds with elements of
    ``dtype``: an FP8 cache holds twice a bf16 one's (its scales are a few bytes per layer)."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = num_layers * num_kv_heads * (head_dim + (head_dim_v or head_dim)) * element
    return memory_bytes // per_token


def _as_count(name: str, value) -> int:
    """``value`` as an int (ints and integer-valued objects such as numpy ints), else TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {value!r}") from None
