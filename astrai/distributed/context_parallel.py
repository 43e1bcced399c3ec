"""Context-parallel paged attention: one sequence's KV cache split over the ranks of a
torch.distributed process group (NCCL on GPUs, gloo on CPUs).

Tokens are dealt round-robin by page: the token at position p of a sequence lives on rank
``(p // page_size) % world_size``, in that rank's own ``PagedKVCache`` (its tokens in order).
Every rank holds the whole step's q, k and v (as after a tensor-parallel or replicated
projection) and returns the same output:

- decode: each rank appends the new tokens it owns, attends over its share with astrai's paged
  decode and ``return_lse=True``, all-gathers ``(out, lse)`` and merges them with
  ``merge_states``; softmax over a union of disjoint key sets is exactly the lse-weighted mix
  of the parts, so the result is single-GPU attention over the whole sequence;
- prefill (a chunk of new tokens after a cached prefix): each rank attends the chunk's queries
  over its share of the prefix (every prefix token is visible to every new query, so no mask
  is needed: each query runs as a decode row over its sequence's cached tokens), the chunk
  attends over itself (causal) on every rank, and the gathered parts merge the same way; each
  rank stores the chunk's tokens it owns. The decode rows read a rank's prefix once per new
  token: right for short chunks after long contexts, wasteful for long chunks (a paged prefill
  whose queries follow their keys would read it once; the op has no such call yet).

The bookkeeping (which rank owns which token, each rank's lengths) is on the host and copied
to the device in one copy per step, as PagedKVCache does: no step reads a device value back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from astrai.extension.backend.call import paged_query_tokens
from astrai.extension.kv_cache import PagedKVCache


def owner_rank(position: int, page_size: int, world_size: int) -> int:
    """The rank that stores the token at ``position`` of a sequence."""
    return (position // page_size) % world_size


@dataclass
class ContextParallelStep:
    """One step's metadata on this rank, on the cache's device."""

    seq_ids: List[int]
    new_tokens: List[int]  # per sequence (host)
    mode: str  # "decode" (one new token each) or "prefill"
    block_table: torch.Tensor  # int32 [B, W]: this rank's pages of each sequence
    cached_lens: torch.Tensor  # int32 [B]: this rank's tokens of each sequence before the step
    seq_lens: torch.Tensor  # int32 [B]: ... after the step
    query_start_loc: torch.Tensor  # int32 [B + 1]: prefix sums of new tokens (all ranks')
    owned: torch.Tensor  # int32 [t]: the packed new tokens this rank stores, in order
    appends: bool  # whether this rank stores any of the step's tokens
    # This rank's share as decode rows, one per new token (the same for every layer): the
    # block-table row and length each query reads here, and the rows' query_start_loc.
    row_table: torch.Tensor  # int32 [T, W]
    row_lens: torch.Tensor  # int32 [T]
    row_starts: torch.Tensor  # int32 [T + 1]

    @property
    def max_query_len(self) -> int:
        return max(self.new_tokens)


class ContextParallelCache:
    """This rank's share of a context-parallel paged KV cache (module docstring).

    Call ``begin_step`` with the same arguments on every rank, then ``attention`` per layer with
    the same q/k/v on every rank; every rank gets the same output.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        group: Optional[dist.ProcessGroup] = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError("ContextParallelCache: call torch.distributed.init_process_group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.local = PagedKVCache(
            num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device
        )
        self.page_size = page_size
        self.device = self.local.device
        self._lengths: Dict[int, int] = {}  # every rank's tokens of each sequence
        self.step: Optional[ContextParallelStep] = None
        # gloo moves host tensors only: CUDA tensors go through the host there (a sync).
        self._through_host = dist.get_backend(group) == "gloo" and self.device.type == "cuda"

    def seq_len(self, seq_id: int) -> int:
        """The sequence's tokens over all ranks."""
        return self._lengths.get(seq_id, 0)

    def free(self, seq_id: int) -> None:
        """Return a finished sequence's pages (on this rank) to the pool."""
        if seq_id not in self._lengths:
            raise KeyError(f"seq_id: {seq_id} is not in the cache")
        del self._lengths[seq_id]
        if self.local.seq_len(seq_id) or self.local.pages_of(seq_id):
            self.local.free(seq_id)
        self.step = None

    def begin_step(
        self, seq_ids: Sequence[int], num_new_tokens: Sequence[int]
    ) -> ContextParallelStep:
        """Deal each sequence's new tokens to their ranks and build this rank's metadata. A
        refused step (ValueError, KVCacheFullError) changes nothing."""
        self.step = None
        seq_ids, counts = self.local._check_step(seq_ids, num_new_tokens)
        owned_per_seq, owned_index, start = [], [], 0
        for seq_id, new in zip(seq_ids, counts):
            old = self.seq_len(seq_id)
            mine = [
                i
                for i in range(new)
                if owner_rank(old + i, self.page_size, self.world_size) == self.rank
            ]
            owned_per_seq.append(len(mine))
            owned_index.extend(start + i for i in mine)
            start += new
        cached = [self.local.seq_len(s) for s in seq_ids]
        storing = [(s, n) for s, n in zip(seq_ids, owned_per_seq) if n]
        if storing:
            self.local.begin_step([s for s, _ in storing], [n for _, n in storing])
        pages = [self.local.pages_of(s) for s in seq_ids]
        batch, width = len(seq_ids), max(1, max(len(p) for p in pages))
        # One host buffer: block_table | cached_lens | seq_lens | query_start_loc | owned |
        # token_seq.
        tokens = sum(counts)
        host = torch.zeros(
            batch * width + 3 * batch + 1 + len(owned_index) + tokens, dtype=torch.int32
        )
        table = host[: batch * width].view(batch, width)
        for b, row in enumerate(pages):
            table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        rest = batch * width
        host[rest : rest + batch] = torch.tensor(cached, dtype=torch.int32)
        host[rest + batch : rest + 2 * batch] = torch.tensor(
            [c + n for c, n in zip(cached, owned_per_seq)], dtype=torch.int32
        )
        starts = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        host[rest + 2 * batch : rest + 3 * batch + 1] = starts
        owned_end = rest + 3 * batch + 1 + len(owned_index)
        host[rest + 3 * batch + 1 : owned_end] = torch.tensor(owned_index, dtype=torch.int32)
        host[owned_end:] = torch.repeat_interleave(torch.arange(batch), torch.tensor(counts))
        if self.device.type == "cuda":
            host = host.pin_memory()
        device = host.to(self.device, non_blocking=True)
        block_table = device[:rest].view(batch, width)
        cached_lens = device[rest : rest + batch]
        seq_lens = device[rest + batch : rest + 2 * batch]
        query_start_loc = device[rest + 2 * batch : rest + 3 * batch + 1]
        decode = all(n == 1 for n in counts)
        if decode:  # a decode query reads its sequence's tokens here, the new one included
            row_table, row_lens, row_starts = block_table, seq_lens, query_start_loc
        else:  # a prefill query reads every cached token of its sequence here
            token_seq = device[owned_end:]
            row_table = block_table.index_select(0, token_seq)
            row_lens = cached_lens.index_select(0, token_seq)
            row_starts = torch.arange(tokens + 1, dtype=torch.int32, device=self.device)
        self.step = ContextParallelStep(
            seq_ids=seq_ids,
            new_tokens=counts,
            mode="decode" if decode else "prefill",
            block_table=block_table,
            cached_lens=cached_lens,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            owned=device[rest + 3 * batch + 1 : owned_end],
            appends=bool(storing),
            row_table=row_table,
            row_lens=row_lens,
            row_starts=row_starts,
        )
        for seq_id, new in zip(seq_ids, counts):
            self._lengths[seq_id] = self.seq_len(seq_id) + new
        return self.step

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int = 0,
        is_causal: bool = True,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        backend: Optional[str] = None,
        return_lse: bool = False,
    ):
        """The step's attention for layer ``layer_id`` over the whole (distributed) sequence.

        q ``[B, 1, Hq, D]`` (decode) or ``[1, T, Hq, D]`` (prefill, new tokens packed); k/v
        the new tokens ``[..., Hkv, D]``, the same on every rank. ``backend`` chooses the paged
        calls' backend (as ``attention(backend=...)``); the chunk's attention over itself is
        resolved as a dense call. Returns out shaped like q (and lse ``q.shape[:-1]``)."""
        step = self.step
        if step is None:
            raise RuntimeError("ContextParallelCache: call begin_step(...) before attention")
        if not is_causal and step.mode == "decode":
            raise ValueError("is_causal: a decode step attends causally (its query is last)")
        q_tokens = paged_query_tokens(q)
        tokens = sum(step.new_tokens)
        if q_tokens.shape[0] != tokens:
            raise ValueError(
                f"q: {q_tokens.shape[0]} query tokens (shape {tuple(q.shape)}), but this step "
                f"(begin_step) adds {tokens} new tokens"
            )
        k_tokens = k.reshape(-1, *k.shape[-2:])
        v_tokens = v.reshape(-1, *v.shape[-2:])
        if step.appends:
            self.local.append(
                layer_id, k_tokens.index_select(0, step.owned), v_tokens.index_select(0, step.owned)
            )
        # This rank's share, as decode rows (begin_step); a prefill's chunk itself is attended
        # to below.
        decode = step.mode == "decode"
        k_pool, v_pool = self.local.layer(layer_id)
        k_scale, v_scale = self.local.scales(layer_id)
        out, lse = torch.ops.astr.attention(
            q_tokens,
            None,
            None,
            None,
            True,
            scale,
            k_pool,
            v_pool,
            step.row_table,
            step.row_lens,
            step.row_starts,
            1,
            "decode",
            backend,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            return_lse=True,
        )
        outs, lses = self._all_gather(out), self._all_gather(lse)
        merged_out, merged_lse = outs[0].float(), lses[0]
        for part_out, part_lse in zip(outs[1:], lses[1:]):
            merged_out, merged_lse = torch.ops.astr.merge_states(
                merged_out, merged_lse, part_out.float(), part_lse
            )
        if not decode:
            chunk_out, chunk_lse = self._chunk_attention(
                q_tokens, k_tokens, v_tokens, is_causal, scale, softcap
            )
            merged_out, merged_lse = torch.ops.astr.merge_states(
                merged_out, merged_lse, chunk_out.float(), chunk_lse
            )
        result = merged_out.to(q.dtype).view(*q.shape[:-1], merged_out.shape[-1])
        if return_lse:
            return result, merged_lse.view(q.shape[:-1])
        return result

    def _chunk_attention(self, q_tokens, k_tokens, v_tokens, is_causal, scale, softcap):
        """Each sequence's new tokens over themselves (dense; the same on every rank)."""
        outs, lses, start = [], [], 0
        for new in self.step.new_tokens:
            end = start + new
            out, lse = torch.ops.astr.attention(
                q_tokens[None, start:end],
                k_tokens[None, start:end],
                v_tokens[None, start:end],
                None,
                is_causal,
                scale,
                softcap=softcap,
                return_lse=True,
            )
            outs.append(out[0])
            lses.append(lse[0])
            start = end
        return torch.cat(outs), torch.cat(lses)

    def _all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        source = tensor.contiguous()
        if self._through_host:
            source = source.cpu()
        parts = [torch.empty_like(source) for _ in range(self.world_size)]
        dist.all_gather(parts, source, group=self.group)
        if self._through_host:
            parts = [p.to(self.device) for p in parts]
        return parts
