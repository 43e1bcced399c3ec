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

Agreement. The ranks must make the same calls with the same arguments. Before anything
collective or anything it writes, each ``begin_step`` and ``attention`` checks its call on its
own rank, then the ranks exchange a signature of it (one all_gather of four int64: which call,
whether this rank refuses it, a digest of its arguments): sequence ids, token counts and
lengths, the sequences freed since the last step, dtypes, shapes, layer, variant arguments and
backend. Every rank accepts the call, or every rank raises the same error: the refusing rank's
own (e.g. ``KVCacheFullError`` when rank 0, which holds the first page of every sequence, runs
out of pages), or ``ContextParallelMismatchError`` naming what differs; a refused call changes
nothing, and the ranks stay in step for the next one. The names are exchanged only then (a
second, larger collective on the failure path). A failure after agreement (one rank's kernel
failing) travels with the results: every rank raises it; that rank's cache has been written.

The bookkeeping (which rank owns which token, each rank's lengths) is on the host and copied
to the device in one copy per step, as PagedKVCache does: no step reads a device value back,
except the signature where the group cannot move host tensors (NCCL alone).
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from astrai.extension.backend.call import paged_query_tokens
from astrai.extension.kv_cache import FP8_DTYPES, KVCacheFullError, PagedKVCache, _as_seq_id


class ContextParallelMismatchError(RuntimeError):
    """The ranks of a ContextParallelCache were called differently for one step (sequences,
    token counts, dtypes, shapes, variant arguments, sequences freed on some ranks only).
    Raised on every rank, naming what differs; the call changed nothing."""


# The errors a refusing rank's error is raised as on every rank: the first class it is an
# instance of (its code is 1 + the index). Anything else arrives as a RuntimeError.
_REFUSALS = (
    KVCacheFullError,
    ContextParallelMismatchError,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    RuntimeError,
)
_CALLS = ("begin_step", "attention")
_SIGNATURE_WORDS = 4  # call, refusal code, digest of the arguments (two 28-bit halves)


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
    the same q/k/v on every rank; every rank gets the same output. A call that any rank refuses,
    or whose arguments differ between ranks, raises the same error on every rank (module
    docstring: Agreement). Not thread-safe, as PagedKVCache.
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
        self._lengths: Dict[object, int] = {}  # every rank's tokens of each sequence
        self._freed: List[object] = []  # sequences freed since the last step (agreed then)
        self.step: Optional[ContextParallelStep] = None
        backend = str(dist.get_backend(group))
        # gloo moves host tensors only: CUDA tensors go through the host there (a sync).
        self._through_host = backend == "gloo" and self.device.type == "cuda"
        # The signatures stay on the host where the group moves host tensors (gloo).
        self._signature_device = torch.device("cpu") if "gloo" in backend else self.device

    def seq_len(self, seq_id) -> int:
        """The sequence's tokens over all ranks."""
        return self._lengths.get(_as_seq_id(seq_id), 0)

    def free(self, seq_id) -> None:
        """Return a finished sequence's pages (on this rank) to the pool. A step that holds the
        sequence ends with it. Free a sequence on every rank: the next ``begin_step`` compares
        the sequences freed since the last step."""
        seq_id = _as_seq_id(seq_id)
        if seq_id not in self._lengths:
            raise KeyError(f"seq_id: {seq_id} is not in the cache")
        del self._lengths[seq_id]
        if self.local.seq_len(seq_id) or self.local.pages_of(seq_id):
            self.local.free(seq_id)
        self._freed.append(seq_id)
        if self.step is not None and seq_id in self.step.seq_ids:
            self.step = None

    # -- steps ---------------------------------------------------------------------------------
    def begin_step(
        self, seq_ids: Sequence[int], num_new_tokens: Sequence[int]
    ) -> ContextParallelStep:
        """Deal each sequence's new tokens to their ranks and build this rank's metadata. A step
        that any rank refuses (ValueError, TypeError, KVCacheFullError) or that differs between
        ranks (ContextParallelMismatchError) raises on every rank and changes nothing, except
        that the previous step ends."""
        self.step = None
        self.local._end_step()
        error, planned = None, None
        try:
            ids, counts = self.local._check_step(seq_ids, num_new_tokens)
            description = {
                "call": "begin_step",
                "seq_ids": ids,
                "num_new_tokens": counts,
                "lengths before the step": [self.seq_len(s) for s in ids],
                "sequences freed since the last step": sorted(map(repr, self._freed)),
                "page_size": self.page_size,
            }
            planned = self._plan_step(ids, counts)
        except Exception as refusal:  # every rank raises it, after the exchange
            error = refusal
            description = {"call": "begin_step", "arguments": repr((seq_ids, num_new_tokens))}
        self._agree(description, error)

        local_planned, step = planned
        if local_planned is not None:
            self.local._commit_step(local_planned)
        for seq_id, new in zip(step.seq_ids, step.new_tokens):
            self._lengths[seq_id] = self.seq_len(seq_id) + new
        self._freed.clear()
        self.step = step
        return step

    def _plan_step(self, seq_ids: list, counts: List[int]):
        """(this rank's planned local step or None, the step's metadata), changing nothing."""
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
        local_planned = None
        pages_of = {}
        if storing:
            local_planned = self.local._plan_step([s for s, _ in storing], [n for _, n in storing])
            pages_of = local_planned.pages_of
        pages = [pages_of.get(s, self.local.pages_of(s)) for s in seq_ids]
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
        step = ContextParallelStep(
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
        return local_planned, step

    # -- attention -----------------------------------------------------------------------------
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
        resolved as a dense call. Returns out shaped like q (and lse ``q.shape[:-1]``). A call
        that any rank refuses, or that differs between ranks, raises the same error on every
        rank before anything is written."""
        error, call = None, None
        description = {
            "call": "attention",
            "layer_id": _plain(layer_id),
            "q": _tensor_form(q),
            "k": _tensor_form(k),
            "v": _tensor_form(v),
            "is_causal": _plain(is_causal),
            "scale": _plain(scale),
            "softcap": _plain(softcap),
            "backend": _plain(backend),
        }
        try:
            call = self._check_attention(q, k, v, layer_id, is_causal, scale, softcap, backend)
        except Exception as refusal:  # every rank raises it, after the exchange
            error = refusal
        self._agree(description, error)

        failure, out, lse = None, None, None
        try:
            out, lse = self._local_attention(call, is_causal, scale, softcap, backend)
        except Exception as late:  # travels with the results: every rank raises it
            failure = late
        outs, lses = self._all_gather_results(out, lse, call, failure)
        merged_out, merged_lse = outs[0].float(), lses[0]
        for part_out, part_lse in zip(outs[1:], lses[1:]):
            merged_out, merged_lse = torch.ops.astr.merge_states(
                merged_out, merged_lse, part_out.float(), part_lse
            )
        if call["chunk"] is not None:
            chunk_out, chunk_lse = call["chunk"]
            merged_out, merged_lse = torch.ops.astr.merge_states(
                merged_out, merged_lse, chunk_out.float(), chunk_lse
            )
        result = merged_out.to(q.dtype).view(*q.shape[:-1], merged_out.shape[-1])
        if return_lse:
            return result, merged_lse.view(q.shape[:-1])
        return result

    def _check_attention(self, q, k, v, layer_id, is_causal, scale, softcap, backend) -> dict:
        """This rank's checks of an attention call, before anything is written or exchanged:
        what the op would refuse too (its own validation and backend choice, through
        explain). Returns what the call needs."""
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
        k_pool, v_pool = self.local.layer(layer_id)
        for name, tensor, pool in (("k", k, k_pool), ("v", v, v_pool)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor of the new tokens, got {tensor!r}")
            heads, dim = pool.shape[-2:]
            if tensor.dim() < 2 or tuple(tensor.shape[-2:]) != (heads, dim):
                raise ValueError(
                    f"{name}: expected [..., kv_heads={heads}, head_dim={dim}], got shape "
                    f"{tuple(tensor.shape)}"
                )
            if tensor.numel() // (heads * dim or 1) != tokens:
                raise ValueError(
                    f"{name}: {tensor.numel() // (heads * dim or 1)} tokens (shape "
                    f"{tuple(tensor.shape)}), but this step (begin_step) adds {tokens}"
                )
            if tensor.device != pool.device:
                raise RuntimeError(
                    f"{name}: expected a tensor on {pool.device}, got {tensor.device}"
                )
            fp8 = pool.dtype in FP8_DTYPES
            if (fp8 and not tensor.dtype.is_floating_point) or (
                not fp8 and tensor.dtype != pool.dtype
            ):
                raise RuntimeError(
                    f"{name}: dtype {tensor.dtype} does not match the cache's {pool.dtype}"
                )
        k_scale, v_scale = self.local.scales(layer_id)
        paged_args = dict(
            k_cache=k_pool,
            v_cache=v_pool,
            block_table=step.row_table,
            seq_lens=step.row_lens,
            query_start_loc=step.row_starts,
            max_query_len=1,
            mode="decode",
            backend=backend,
            is_causal=True,
            scale=scale,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            return_lse=True,
        )
        _refuse_unless_runnable(torch.ops.astr.explain(q_tokens, **paged_args))
        k_tokens = k.reshape(-1, *k.shape[-2:])
        v_tokens = v.reshape(-1, *v.shape[-2:])
        if step.mode == "prefill":  # the chunk over itself: a dense call per sequence
            for args in self._chunk_calls(q_tokens, k_tokens, v_tokens, is_causal, scale, softcap):
                _refuse_unless_runnable(torch.ops.astr.explain(**args))
        return dict(
            layer_id=layer_id,
            q_tokens=q_tokens,
            k_tokens=k_tokens,
            v_tokens=v_tokens,
            paged_args=paged_args,
            chunk=None,
        )

    def _local_attention(self, call, is_causal, scale, softcap, backend):
        """Appends this rank's tokens and attends over its share (and, for a prefill, the chunk
        over itself, into call["chunk"]). Returns (out, lse) of the share."""
        step = self.step
        if step.appends:
            self.local.append(
                call["layer_id"],
                call["k_tokens"].index_select(0, step.owned),
                call["v_tokens"].index_select(0, step.owned),
            )
        # This rank's share, as decode rows (begin_step).
        out, lse = torch.ops.astr.attention(call["q_tokens"], **call["paged_args"])
        if step.mode == "prefill":
            call["chunk"] = self._chunk_attention(
                call["q_tokens"], call["k_tokens"], call["v_tokens"], is_causal, scale, softcap
            )
        return out, lse

    def _chunk_calls(self, q_tokens, k_tokens, v_tokens, is_causal, scale, softcap):
        """The op's arguments of each sequence's new tokens over themselves (dense)."""
        start = 0
        for new in self.step.new_tokens:
            end = start + new
            yield dict(
                q=q_tokens[None, start:end],
                k=k_tokens[None, start:end],
                v=v_tokens[None, start:end],
                is_causal=is_causal,
                scale=scale,
                softcap=softcap,
                return_lse=True,
            )
            start = end

    def _chunk_attention(self, q_tokens, k_tokens, v_tokens, is_causal, scale, softcap):
        """Each sequence's new tokens over themselves (dense; the same on every rank)."""
        outs, lses = [], []
        for args in self._chunk_calls(q_tokens, k_tokens, v_tokens, is_causal, scale, softcap):
            out, lse = torch.ops.astr.attention(**args)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses)

    # -- collectives ---------------------------------------------------------------------------
    def _agree(self, description: dict, error: Optional[Exception]) -> None:
        """Returns when every rank accepts the same call; else raises the same error on every
        rank (module docstring: Agreement). One small all_gather; a second one, of the names,
        only when something differs."""
        text = json.dumps(description, sort_keys=True, default=repr)
        digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
        signature = [
            _CALLS.index(description["call"]),
            _refusal_code(error),
            digest >> 28,
            digest & (2**28 - 1),
        ]
        mine = torch.tensor(signature, dtype=torch.int64, device=self._signature_device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.group)
        signatures = torch.stack(parts).tolist()  # one read-back
        if all(s[1] == 0 for s in signatures) and all(s == signatures[0] for s in signatures):
            return
        # The failure path: every rank learns every rank's call and refusal, to name them.
        local = (
            description,
            None if error is None else (type(error).__name__, _error_text(error)),
        )
        views = [None] * self.world_size
        dist.all_gather_object(views, local, group=self.group)
        refusing = [r for r, s in enumerate(signatures) if s[1] != 0]
        if refusing:
            first = refusing[0]
            cls = _REFUSALS[signatures[first][1] - 1]
            name, text = views[first][1]
            message = f"rank {first} refused this {views[first][0]['call']}: {name}: {text}"
            if len(refusing) > 1:
                message += f" (refused on ranks {refusing})"
            raise cls(message) from error
        raise ContextParallelMismatchError(_describe_mismatch([v[0] for v in views])) from error

    def _all_gather_results(self, out, lse, call, failure) -> tuple:
        """Every rank's (out, lse), in one all_gather of bytes with a status byte: a rank whose
        computation failed after agreement sends its error's status, and every rank raises."""
        q_tokens = call["q_tokens"]
        tokens, q_heads = q_tokens.shape[0], q_tokens.shape[1]
        head_dim_v = self.local.head_dim_v
        out_dtype = q_tokens.dtype
        lse_bytes = tokens * q_heads * 4
        out_bytes = tokens * q_heads * head_dim_v * q_tokens.element_size()
        if failure is None:
            source = torch.cat(
                [
                    lse.contiguous().view(-1).view(torch.uint8),
                    out.contiguous().view(-1).view(torch.uint8),
                    torch.zeros(1, dtype=torch.uint8, device=out.device),
                ]
            )
        else:
            source = torch.zeros(lse_bytes + out_bytes + 1, dtype=torch.uint8, device=self.device)
            source[-1] = 1
        if self._through_host:
            source = source.cpu()
        parts = [torch.empty_like(source) for _ in range(self.world_size)]
        dist.all_gather(parts, source, group=self.group)
        statuses = torch.stack([p[-1] for p in parts]).tolist()  # one read-back
        failed = [r for r, status in enumerate(statuses) if status != 0]
        if failed:
            views = [None] * self.world_size
            local = None if failure is None else (type(failure).__name__, _error_text(failure))
            dist.all_gather_object(views, local, group=self.group)
            name, text = views[failed[0]]
            cls = _REFUSALS[_refusal_code_by_name(name) - 1]
            raise cls(
                f"rank {failed[0]} failed in attention after the ranks agreed: {name}: {text}"
            )
        if self._through_host:
            parts = [p.to(self.device) for p in parts]
        outs = [p[lse_bytes:-1].view(out_dtype).view(tokens, q_heads, head_dim_v) for p in parts]
        lses = [p[:lse_bytes].view(torch.float32).view(tokens, q_heads) for p in parts]
        return outs, lses


def _plain(value):
    """A scalar argument as the ranks compare it: ints and floats by value, whatever their type
    (a numpy float equals the same Python float), anything else by its repr."""
    if value is None or isinstance(value, (bool, str)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        pass
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def _tensor_form(tensor) -> str:
    """What the ranks must agree on about a tensor argument: its dtype and shape."""
    if not isinstance(tensor, torch.Tensor):
        return repr(type(tensor).__name__)
    return f"{tensor.dtype} {list(tensor.shape)}"


def _refuse_unless_runnable(decision_json: str) -> None:
    decision = json.loads(decision_json)
    if decision["backend"] is None:
        raise RuntimeError(decision["error"])


def _refusal_code(error: Optional[Exception]) -> int:
    if error is None:
        return 0
    for code, cls in enumerate(_REFUSALS, start=1):
        if isinstance(error, cls):
            return code
    return _REFUSALS.index(RuntimeError) + 1


def _refusal_code_by_name(name: str) -> int:
    for code, cls in enumerate(_REFUSALS, start=1):
        if cls.__name__ == name:
            return code
    return _REFUSALS.index(RuntimeError) + 1


def _error_text(error: Exception) -> str:
    # KeyError's str() quotes its argument: take the argument itself.
    if isinstance(error, KeyError) and len(error.args) == 1:
        return str(error.args[0])
    return str(error)


def _describe_mismatch(descriptions: List[dict]) -> str:
    """'<what>: rank 0 has X, rank 1 has Y' for the first argument the ranks differ in."""
    ranks = range(len(descriptions))
    calls = [d.get("call") for d in descriptions]
    if len(set(calls)) > 1:
        found = ", ".join(f"rank {r} is in {calls[r]}" for r in ranks)
        return f"the ranks are in different calls: {found}"
    keys = list(descriptions[0])
    for d in descriptions[1:]:
        keys += [key for key in d if key not in keys]
    for key in keys:
        values = [d.get(key, "(not given)") for d in descriptions]
        if any(value != values[0] for value in values):
            found = ", ".join(f"rank {r} has {values[r]}" for r in ranks)
            return f"{calls[0]}: {key} differs between ranks: {found}"
    return f"{calls[0]}: the ranks' calls differ"
