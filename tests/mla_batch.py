"""A ragged batch over a paged latent pool, for the latent attention tests (CPU and GPU): fresh
random latents on shuffled pages, every slot that no sequence owns NaN (a backend that reads past
a sequence's length shows NaN), block-table columns past a sequence's pages pointing outside the
pool (never read)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tests.mla_reference import mla_reference, quantize_latent

LATENT_DIM, ROPE_DIM = 512, 64


class LatentBatch:
    """Sequences of lengths ``seq_lens`` whose last ``q_lens`` tokens are new (decode: one each,
    ``decode=True``); ``heads`` query heads; pools of ``page_size`` slots. ``fp8``: the latent pool
    holds e4m3 bytes of ``ckv_scale`` (the reference reads them dequantized)."""

    def __init__(
        self,
        seq_lens: Sequence[int],
        q_lens: Sequence[int],
        *,
        heads: int,
        page_size: int,
        dtype: torch.dtype,
        device="cpu",
        fp8: bool = False,
        decode: bool = False,
        seed: int = 0,
        latent_dim: int = LATENT_DIM,
        rope_dim: int = ROPE_DIM,
        spare_pages: int = 3,
        extra_width: int = 1,
    ):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens_list, self.q_lens_list = list(seq_lens), list(q_lens)
        self.decode, self.page_size, self.dtype = decode, page_size, dtype
        pages_per_seq = [max(1, -(-n // page_size)) for n in seq_lens]
        num_pages = sum(pages_per_seq) + spare_pages

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device)

        latents = randn(num_pages, page_size, latent_dim)
        self.krope_cache = randn(num_pages, page_size, rope_dim).to(dtype)
        width = max(pages_per_seq) + extra_width
        self.block_table = torch.full((len(seq_lens), width), 1 << 30, dtype=torch.int32)
        owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
        perm = torch.randperm(num_pages, generator=g)
        taken = 0
        for b, (length, pages) in enumerate(zip(seq_lens, pages_per_seq)):
            ids = perm[taken : taken + pages]
            taken += pages
            self.block_table[b, :pages] = ids.int()
            positions = torch.arange(length)
            owned[ids[positions // page_size] * page_size + positions % page_size] = True
        owned = owned.to(device)
        self.block_table = self.block_table.to(device)
        if fp8:
            # A scale far from 1 (the latents' amax lands near e4m3's largest value): a backend
            # that ignored it would be off by this factor.
            self.ckv_scale = torch.tensor([float(latents.abs().max()) / 400.0], device=device)
            self.ckv_cache = quantize_latent(latents, self.ckv_scale)
        else:
            self.ckv_scale = None
            self.ckv_cache = latents.to(dtype)
        nan_latent = torch.full((latent_dim,), float("nan"), device=device)
        self.ckv_cache.view(-1, latent_dim)[~owned] = nan_latent.to(self.ckv_cache.dtype)
        self.krope_cache.view(-1, rope_dim)[~owned] = float("nan")
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.num_tokens = starts[-1]
        self.max_query_len = max(q_lens) if q_lens else 1
        self.q_nope = randn(self.num_tokens, heads, latent_dim).to(dtype)
        self.q_rope = randn(self.num_tokens, heads, rope_dim).to(dtype)
        self.scale = 1.0 / math.sqrt(latent_dim + rope_dim)

    @property
    def mode(self) -> str:
        return "decode" if self.decode else "prefill"

    def op_args(self) -> tuple:
        """The positional arguments of torch.ops.astr.mla_attention (and the Python API)."""
        return (
            self.q_nope,
            self.q_rope,
            self.ckv_cache,
            self.krope_cache,
            self.block_table,
            self.seq_lens,
            self.query_start_loc,
            self.max_query_len,
            self.mode,
            self.scale,
        )

    def reference(self, *, is_causal: bool = True, return_lse: bool = False, ignore_scale=False):
        """The float64 reference at the batch's lengths. ``ignore_scale``: an FP8 latent read as
        its bytes alone, the control that a backend ignoring ckv_scale would match."""
        return mla_reference(
            self.q_nope,
            self.q_rope,
            self.ckv_cache,
            self.krope_cache,
            self.block_table,
            self.seq_lens_list,
            self.query_start_loc,
            scale=self.scale,
            is_causal=is_causal,
            ckv_scale=None if ignore_scale else self.ckv_scale,
            return_lse=return_lse,
        )
