"""A paged KV cache: per-layer K/V pools of fixed-size pages, pages handed to sequences as
they grow, and each step's metadata built on the host and copied to the device in one copy.

Pool layout: ``[num_pages, page_size, kv_heads, head_dim]`` (v: ``head_dim_v``). A sequence's
tokens live in the pages its block-table row lists, in order; token ``i`` is at slot ``page *
page_size + i % page_size`` of page ``block_table[b, i // page_size]``. Every layer shares the
pages and the step metadata; each layer may have its own kv heads and head dims (Gemma 4: head
dim 512 on its global layers, 256 on its sliding ones): pass a sequence of one value per layer.

FP8 caches (``dtype=torch.float8_e4m3fn`` or ``torch.float8_e5m2``) keep one byte per element
and a float32 scale per layer and kv head (``k_scales[layer]``, ``v_scales[layer]``, 1.0 at
first): a token is stored as ``fp8(clamp(x / scale, -max, max))`` and read as
``stored.float() * scale``. The model stays in bf16/fp16. Set the scales before the first
tokens are written (``set_scales``, or ``scales_from`` on the first prefill's k/v): a page
written under one scale is read with whatever the scale is at read time.

Writes never carry autograd history: k/v that require grad (a model run outside
``torch.no_grad()``) are stored as their values, so a cache never keeps a step's graph alive.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import ops

SUPPORTED_PAGE_SIZES = tuple(2**i for i in range(9))  # 1, 2, 4, ..., 256
PerLayer = Union[int, Sequence[int]]  # one value for every layer, or one per layer
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


# Slots are addressed by an int32 slot mapping (astr::append_kv): slot ids 0 .. 2^31 - 1.
MAX_POOL_SLOTS = 2**31 - 1


@dataclass
class _PlannedStep:
    """A step built but not yet taken (PagedKVCache._plan_step)."""

    step: StepMetadata
    seq_ids: list
    new_lengths: List[int]
    pages_of: Dict[object, List[int]]  # every page of each of the step's sequences
    free_pages: List[int]  # the free list once the step has taken its pages


class PagedKVCache:
    """Per-layer paged K/V pools plus the page allocator and step-metadata builder.

    Not thread-safe: ``begin_step``, ``append``, ``free`` and the scale setters change shared
    state without a lock. Use one cache per serving loop (one thread or one asyncio task), or
    serialise the calls yourself.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: PerLayer,
        head_dim: PerLayer,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        head_dim_v: Optional[PerLayer] = None,
    ):
        """``num_kv_heads``, ``head_dim`` and ``head_dim_v`` (default: ``head_dim``): one int for
        every layer, or a sequence of one int per layer."""
        num_layers = _as_positive_count("num_layers", num_layers)
        num_pages = _as_positive_count("num_pages", num_pages)
        page_size = _as_count("page_size", page_size)
        kv_heads = _per_layer("num_kv_heads", num_kv_heads, num_layers)
        head_dims = _per_layer("head_dim", head_dim, num_layers)
        head_dims_v = (
            head_dims if head_dim_v is None else _per_layer("head_dim_v", head_dim_v, num_layers)
        )
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(
                f"page_size: {page_size} not supported (supported: {list(SUPPORTED_PAGE_SIZES)})"
            )
        if num_pages * page_size > MAX_POOL_SLOTS:
            raise ValueError(
                f"num_pages: {num_pages} pages of {page_size} slots make a pool of "
                f"{num_pages * page_size} slots, more than an int32 slot mapping addresses "
                f"(at most 2^31 - 1 = {MAX_POOL_SLOTS}); use fewer or larger pages"
            )
        _check_cache_dtype(dtype)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        # Per layer (each a tuple of num_layers ints); num_kv_heads, head_dim and head_dim_v
        # read them when every layer agrees.
        self.layer_kv_heads = kv_heads
        self.layer_head_dims = head_dims
        self.layer_head_dims_v = head_dims_v
        self.dtype = dtype
        self.device = torch.device(device)
        self.k_pools = [
            torch.zeros((num_pages, page_size, h, d), dtype=dtype, device=self.device)
            for h, d in zip(kv_heads, head_dims)
        ]
        self.v_pools = [
            torch.zeros((num_pages, page_size, h, d), dtype=dtype, device=self.device)
            for h, d in zip(kv_heads, head_dims_v)
        ]
        # FP8 pools: per-layer, per-kv-head dequantization scales (module docstring).
        self.k_scales: List[torch.Tensor] = []
        self.v_scales: List[torch.Tensor] = []
        if self.is_fp8:
            self.k_scales = [
                torch.ones(h, dtype=torch.float32, device=self.device) for h in kv_heads
            ]
            self.v_scales = [s.clone() for s in self.k_scales]
        self._free_pages: List[int] = list(range(num_pages - 1, -1, -1))  # pop() takes page 0 first
        self._pages: Dict[int, List[int]] = {}
        self._lengths: Dict[int, int] = {}
        self.step: Optional[StepMetadata] = None
        self._step_seq_ids: frozenset = frozenset()  # the sequences self.step writes to

    # -- shapes ------------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return _same_for_every_layer("num_kv_heads", "layer_kv_heads", self.layer_kv_heads)

    @property
    def head_dim(self) -> int:
        return _same_for_every_layer("head_dim", "layer_head_dims", self.layer_head_dims)

    @property
    def head_dim_v(self) -> int:
        return _same_for_every_layer("head_dim_v", "layer_head_dims_v", self.layer_head_dims_v)

    # -- sequences and pages -------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def seq_len(self, seq_id: int) -> int:
        return self._lengths.get(_as_seq_id(seq_id), 0)

    def pages_of(self, seq_id: int) -> List[int]:
        return list(self._pages.get(_as_seq_id(seq_id), []))

    def free(self, seq_id: int) -> None:
        """Return a finished sequence's pages to the pool. A step that writes to the sequence
        ends with it (``step`` becomes None): its slots may soon belong to another sequence."""
        seq_id = _as_seq_id(seq_id)
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
        layer_id = _as_count("layer_id", layer_id)
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer_id: {layer_id} out of range for {self.num_layers} layers")
        return self.k_pools[layer_id], self.v_pools[layer_id]

    def _layer_shape(self, layer_id: int) -> Tuple[int, int, int]:
        """(kv_heads, head_dim, head_dim_v) of a layer (layer_id already checked)."""
        layer_id = operator.index(layer_id)
        return (
            self.layer_kv_heads[layer_id],
            self.layer_head_dims[layer_id],
            self.layer_head_dims_v[layer_id],
        )

    # -- FP8 scales ------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    def scales(self, layer_id: int) -> tuple:
        """(k_scale, v_scale) of a layer: float32 [kv_heads] for FP8 pools, (None, None) else."""
        self.layer(layer_id)  # checks layer_id
        if not self.is_fp8:
            return None, None
        layer_id = operator.index(layer_id)
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def set_scales(self, layer_id: int, k_scale, v_scale) -> None:
        """Set a layer's FP8 scales: each a positive finite float or a float32 ``[kv_heads]``
        tensor. Copied in place, so a captured CUDA graph sees the new values."""
        if not self.is_fp8:
            raise ValueError(f"set_scales: the cache holds {self.dtype}, not an FP8 dtype")
        self.layer(layer_id)
        layer_id = operator.index(layer_id)
        kv_heads = self.layer_kv_heads[layer_id]
        new = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            try:
                # Values only: a scale that requires grad would make every later output do so.
                if isinstance(value, torch.Tensor):
                    value = value.detach()
                tensor = torch.as_tensor(value, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(
                    f"{name}: expected a float or a float32 [kv_heads={kv_heads}] "
                    f"tensor, got {value!r}"
                ) from None
            if tensor.dim() == 0:
                tensor = tensor.expand(kv_heads)
            if tuple(tensor.shape) != (kv_heads,):
                raise ValueError(
                    f"{name}: expected a float or [kv_heads={kv_heads}], got shape "
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
        kv_heads, head_dim, head_dim_v = self._layer_shape(layer_id)
        scales = []
        for name, tensor, dim in (("k", k, head_dim), ("v", v, head_dim_v)):
            _check_tokens_shape(name, tensor, kv_heads, dim)
            amax = tensor.detach().reshape(-1, kv_heads, dim).abs()
            amax = amax.amax(dim=(0, 2)).float()
            bad = ~torch.isfinite(amax)
            if bool(bad.any()):  # a NaN head would get scale 1 (NaN > 0 is false), inf scale inf
                heads = bad.nonzero().flatten().tolist()
                raise ValueError(
                    f"{name}: kv heads {heads} hold NaN or inf values; no FP8 scale fits them"
                )
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
        return self._commit_step(self._plan_step(seq_ids, counts, block_table_width))

    def _plan_step(self, seq_ids: list, counts: List[int], block_table_width=None) -> _PlannedStep:
        """Everything a step of these (checked) sequences and counts needs, built without
        changing the cache (astrai.distributed commits it only once every rank accepts its
        own); raises KVCacheFullError or ValueError as begin_step does."""
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

        return _PlannedStep(step, seq_ids, new_lengths, pages_of, free)

    def _commit_step(self, planned: _PlannedStep) -> StepMetadata:
        """Make a planned step the current one: its pages taken, its lengths recorded."""
        self._free_pages = planned.free_pages
        for seq_id, length in zip(planned.seq_ids, planned.new_lengths):
            self._pages[seq_id] = planned.pages_of[seq_id]
            self._lengths[seq_id] = length
        self.step = planned.step
        self._step_seq_ids = frozenset(planned.seq_ids)
        return planned.step

    def _check_step(self, seq_ids, num_new_tokens) -> Tuple[list, List[int]]:
        """The ids as a list and the new-token counts as ints, after checking both; raises,
        changing nothing."""
        try:
            seq_ids, num_new_tokens = list(seq_ids), list(num_new_tokens)
        except TypeError:
            raise TypeError("seq_ids, num_new_tokens: expected two sequences") from None
        if len(seq_ids) != len(num_new_tokens) or not seq_ids:
            raise ValueError("seq_ids, num_new_tokens: expected two non-empty lists of one length")
        seq_ids = [_as_seq_id(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: a sequence appears twice in one step")
        counts = [_as_count("num_new_tokens", n) for n in num_new_tokens]
        if any(n < 1 for n in counts):
            raise ValueError("num_new_tokens: every sequence must add at least one token")
        return seq_ids, counts

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's new tokens' k/v ``[..., kv_heads, head_dim]`` into a layer's pools."""
        if self.step is None:
            raise RuntimeError("kv_cache: call begin_step(...) before appending")
        k_pool, v_pool = self.layer(layer_id)
        kv_heads, head_dim, head_dim_v = self._layer_shape(layer_id)
        for name, tensor, dim in (("k", k, head_dim), ("v", v, head_dim_v)):
            _check_tokens_shape(name, tensor, kv_heads, dim)
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
            k.reshape(-1, kv_heads, head_dim),
            v.reshape(-1, kv_heads, head_dim_v),
            k_pool,
            v_pool,
            self.step.slot_mapping,
            k_scale,
            v_scale,
        )


def tokens_that_fit(
    memory_bytes: int,
    num_layers: int,
    num_kv_heads: PerLayer,
    head_dim: PerLayer,
    dtype: torch.dtype,
    head_dim_v: Optional[PerLayer] = None,
) -> int:
    """How many tokens' K and V (every layer) a cache of ``memory_bytes`` holds with elements of
    ``dtype``: an FP8 cache holds twice a bf16 one's (its scales are a few bytes per layer).
    Shapes as ``PagedKVCache`` takes them (an int, or one per layer)."""
    memory_bytes = _as_count("memory_bytes", memory_bytes)
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes: expected a count of bytes >= 0, got {memory_bytes}")
    num_layers = _as_positive_count("num_layers", num_layers)
    kv_heads = _per_layer("num_kv_heads", num_kv_heads, num_layers)
    head_dims = _per_layer("head_dim", head_dim, num_layers)
    head_dims_v = (
        head_dims if head_dim_v is None else _per_layer("head_dim_v", head_dim_v, num_layers)
    )
    _check_cache_dtype(dtype)
    element = torch.empty((), dtype=dtype).element_size()
    per_token = sum(h * (d + dv) for h, d, dv in zip(kv_heads, head_dims, head_dims_v)) * element
    return memory_bytes // per_token


def _as_count(name: str, value) -> int:
    """``value`` as an int (ints and integer-valued objects such as numpy ints), else TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {value!r}") from None


def _as_positive_count(name: str, value) -> int:
    count = _as_count(name, value)
    if count < 1:
        raise ValueError(f"{name}: expected a positive integer, got {count}")
    return count


def _per_layer(name: str, value, num_layers: int) -> Tuple[int, ...]:
    """One positive int per layer, from an int (every layer) or a sequence of num_layers."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(
                f"{name}: expected an integer or one per layer ({num_layers}), got {len(value)} "
                f"values"
            )
        return tuple(_as_positive_count(f"{name}[{i}]", v) for i, v in enumerate(value))
    return (_as_positive_count(name, value),) * num_layers


def _same_for_every_layer(name: str, per_layer: str, values: Tuple[int, ...]) -> int:
    """The one value that every layer shares, or a ValueError naming the per-layer attribute."""
    if len(set(values)) != 1:
        raise ValueError(
            f"{name}: the layers differ ({list(values)}); read {per_layer}[layer] instead"
        )
    return values[0]


def _as_seq_id(seq_id):
    """A sequence id as the cache keys it: an integer-valued object (a 0-d integer tensor, a
    numpy int) as its int, so that equal ids are one sequence; other hashables as they are."""
    if isinstance(seq_id, torch.Tensor):
        if seq_id.dim() != 0 or seq_id.is_floating_point() or seq_id.is_complex():
            raise TypeError(f"seq_ids: expected integer ids, got a tensor {seq_id!r}")
        return int(seq_id)
    if not isinstance(seq_id, (bool, str)) and hasattr(type(seq_id), "__index__"):
        return operator.index(seq_id)
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"seq_ids: expected hashable ids, got {seq_id!r}") from None
    return seq_id


def _check_cache_dtype(dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype in FP8_DTYPES):
        raise TypeError(
            f"dtype: expected a floating-point torch.dtype (or an FP8 one), got {dtype!r}"
        )


def _check_tokens_shape(name: str, tensor, num_kv_heads: int, head_dim: int) -> None:
    """``tensor`` holds tokens' k or v: a tensor ``[..., kv_heads, head_dim]``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{name}: expected a tensor [..., kv_heads={num_kv_heads}, head_dim={head_dim}] of "
            f"the new tokens, got {type(tensor).__name__}"
        )
    if tensor.dim() < 2 or tuple(tensor.shape[-2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"{name}: expected [..., kv_heads={num_kv_heads}, head_dim={head_dim}], "
            f"got shape {tuple(tensor.shape)}"
        )
