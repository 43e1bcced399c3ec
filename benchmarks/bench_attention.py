"""Attention benchmark: astrai's paged op against torch SDPA, side by side in one process.

    python3 benchmarks/bench_attention.py                      # full run (make bench), < 8 min
    python3 benchmarks/bench_attention.py --quick              # fewer shapes, < 3 min
    python3 benchmarks/bench_attention.py --only decode --backends cuda,sdpa_cudnn
    python3 benchmarks/bench_attention.py --selftest           # no GPU: counting + report writing

Peers (``--backends`` takes ids or the groups astrai, cuda, sdpa):
  cuda_ps16, cuda_ps1     torch.ops.astr.attention(..., backend="cuda"), page size 16 / 1
  torch_native            torch.ops.astr.attention(..., backend="torch_native"), page size 16
  astrai_flash            torch.ops.astr.attention(..., backend="flash"), page size 256
                          (flash-attn's paged KV needs pages of a multiple of 256 tokens)
  sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math
                          F.scaled_dot_product_attention under sdpa_kernel([one backend])
  sdpa_default            F.scaled_dot_product_attention, torch's own choice
The astrai peers read a paged pool whose pages were handed out by a random permutation (every
sequence's pages scattered over the pool); the SDPA peers read the same values as contiguous
[B, H, L, D] tensors (GQA through enable_gqa).

Method (benchmarks/README.md has the details): ceilings measured in the same process (4 GiB
device-to-device copy, bytes read + written; bf16 8192^3 matmul); every peer's first output is
compared with a float32 reference (rel L2 error recorded); then warm-up and the median of
``--repeats`` CUDA-event timings, a 256 MB buffer read between runs to flush L2 (``--flush``). A
peer that raises is recorded with its error and the run goes on. Outputs (under --out):
bench_<gpu>_<date>.json/.md, decode_tbps.png, prefill_tflops.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "benchmarks/bench_attention.py"
DTYPE = torch.bfloat16
ELEMENT_BYTES = 2
FLUSH_BYTES = 256 << 20  # larger than the H200's L2 (60 MB): each timed run starts cold
VERIFY_TOLERANCE = 2e-2  # bf16 operands land between 1e-3 and 1e-2 against a float32 reference
REFERENCE_BUDGET = 1 << 30  # bytes of float32 working set per reference chunk
DEVICE = "cuda"  # --selftest's CPU smoke run sets "cpu" (host clock, no flush)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_cached() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------------
ASTRAI_PEERS: Dict[str, Tuple[str, int]] = {  # id -> (op backend name, page size)
    "cuda_ps16": ("cuda", 16),
    "cuda_ps1": ("cuda", 1),
    "torch_native": ("torch_native", 16),
    "astrai_flash": ("flash", 256),
}
SDPA_PEERS: Dict[str, Optional[str]] = {  # id -> torch.nn.attention.SDPBackend member name
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_math": "MATH",
    "sdpa_default": None,
}
ALL_PEERS = list(ASTRAI_PEERS) + list(SDPA_PEERS)
DECODE_PEERS = ALL_PEERS
PREFILL_PEERS = [p for p in ALL_PEERS if p != "cuda_ps1"]
PEER_GROUPS = {
    "astrai": list(ASTRAI_PEERS),
    "cuda": ["cuda_ps16", "cuda_ps1"],
    "sdpa": list(SDPA_PEERS),
}
MATH_PREFILL_MAX_S = 4096  # the math backend materializes S x S scores: only short prefills
# torch_native hands SDPA a bool mask; with GQA no fused SDPA kernel takes that (efficient refuses
# GQA, flash refuses masks), so it lands on math, which materializes B*Hq*max_q*capacity scores
# (several times over: scores, softmax). Above this many bytes of bf16 scores the row is skipped
# (B=1 S=16384 would need ~17 GB per copy; the run must stay under 60 GB).
TORCH_NATIVE_GQA_SCORES_LIMIT = 8e9

# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------
HQ, HKV, HEAD_DIM = 32, 8, 128
DECODE_SHAPES = [  # (B, L, Hkv): the anchors' decode shapes
    (1, 32768, 8),
    (16, 4096, 8),
    (64, 4096, 8),
    (128, 2048, 8),
    (32, 4096, 32),
]
DECODE_SWEEP_B = 16
DECODE_SWEEP_L = [512, 1024, 2048, 4096, 8192, 16384, 32768]
DECODE_SWEEP_L_QUICK = [512, 2048, 8192, 32768]
PREFILL_SHAPES = [  # (B, S, H, D): the anchors' prefill shapes
    (4, 2048, 32, 128),
    (2, 4096, 32, 128),
    (1, 8192, 32, 128),
    (1, 16384, 32, 128),
    (4, 4096, 16, 64),
]
PREFILL_SHAPES_QUICK = [PREFILL_SHAPES[0], PREFILL_SHAPES[1], PREFILL_SHAPES[4]]
PREFILL_SWEEP_S = [1024, 2048, 4096, 8192, 16384]
PREFILL_SWEEP_S_QUICK = [1024, 4096, 16384]
GQA_GROUP = 4  # the GQA rows use H / 4 kv heads (32/8 at H = 32)
RAGGED = dict(batch=8, prefix=(0, 4096), chunk=(256, 2048))  # inclusive ranges

# --------------------------------------------------------------------------------------------
# Anchors: /work/shared/anchors/h200-sdpa-2026-12-02.json (sdpa_baseline.py; torch 2.11.0+cu130,
# NVIDIA H200, 132 SMs). Copied here because the device machine sees only the repository.
# --------------------------------------------------------------------------------------------
ANCHOR_SOURCE = "shared/anchors/h200-sdpa-2026-12-02.json (sdpa_baseline.py, H200, torch 2.11)"
ANCHOR_CEILINGS = {"copy_TBps": 4.2177, "matmul_TFLOPs": 750.47}
ANCHOR_DECODE = {  # (B, Hq, Hkv, L, D) -> effective TB/s
    (1, 32, 8, 32768, 128): {"flash": 1.73, "cudnn": 2.01, "math": 0.08, "gather+sdpa": 1.0},
    (16, 32, 8, 4096, 128): {"flash": 2.63, "cudnn": 2.95, "math": 0.09, "gather+sdpa": 1.16},
    (64, 32, 8, 4096, 128): {"flash": 2.48, "cudnn": 3.89, "math": 0.09, "gather+sdpa": 1.27},
    (128, 32, 8, 2048, 128): {"flash": 2.47, "cudnn": 3.93, "math": 0.09, "gather+sdpa": 1.3},
    (32, 32, 32, 4096, 128): {
        "flash": 2.61,
        "efficient": 2.52,
        "cudnn": 4.18,
        "math": 0.37,
        "gather+sdpa": 1.29,
    },
}
ANCHOR_DECODE_FLOOR_US = {
    (1, 32, 8, 32768, 128): 31.8,
    (16, 32, 8, 4096, 128): 63.7,
    (64, 32, 8, 4096, 128): 254.8,
    (128, 32, 8, 2048, 128): 255.1,
    (32, 32, 32, 4096, 128): 509.3,
}
ANCHOR_DECODE_COLUMNS = ["flash", "efficient", "cudnn", "math", "gather+sdpa"]
ANCHOR_PREFILL = {  # (B, H, S, D), MHA, causal -> TFLOP/s
    (4, 32, 2048, 128): {
        "flash": 235.2,
        "efficient": 147.7,
        "cudnn": 411.2,
        "math": 10.9,
        "default": 474.8,
    },
    (2, 32, 4096, 128): {
        "flash": 297.3,
        "efficient": 158.9,
        "cudnn": 554.2,
        "math": 10.5,
        "default": 509.2,
    },
    (1, 32, 8192, 128): {"flash": 308.2, "efficient": 162.7, "cudnn": 564.5, "default": 566.3},
    (1, 32, 16384, 128): {"flash": 330.7, "efficient": 171.8, "cudnn": 622.1, "default": 578.6},
    (4, 16, 4096, 64): {
        "flash": 233.8,
        "efficient": 109.8,
        "cudnn": 386.2,
        "math": 6.5,
        "default": 388.6,
    },
}
ANCHOR_PREFILL_COLUMNS = ["flash", "efficient", "cudnn", "math", "default"]


# --------------------------------------------------------------------------------------------
# Counting: bytes and FLOPs (pure functions; --selftest checks them)
# --------------------------------------------------------------------------------------------
def decode_bytes(batch: int, length: int, hq: int, hkv: int, head_dim: int) -> int:
    """Fewest bytes a decode step moves: K and V of every live token read once, plus q read
    and the output written (the anchors' convention: ``2 * k.numel() * 2 + 2 * q.numel() * 2``).
    The block table (4 bytes per page) is left out: under 0.1% of K+V at page size 1."""
    kv = 2 * batch * length * hkv * head_dim * ELEMENT_BYTES
    q_and_out = 2 * batch * hq * head_dim * ELEMENT_BYTES
    return kv + q_and_out


def causal_prefill_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """The anchors' convention for a square causal prefill: 4 * B * H * S * S * D / 2 (two
    matmuls of 2 FLOPs per multiply-add over half the S x S score matrix)."""
    return 2 * batch * heads * seq * seq * head_dim


def visible_pairs(prefix_lens: Sequence[int], chunk_lens: Sequence[int]) -> int:
    """Exact (query, key) pairs a causal chunked prefill computes: new token i of a sequence
    with p cached tokens sees keys 0 .. p + i, i.e. p + i + 1 of them."""
    return sum(c * p + c * (c + 1) // 2 for p, c in zip(prefix_lens, chunk_lens))


def ragged_prefill_flops(
    prefix_lens: Sequence[int], chunk_lens: Sequence[int], heads: int, head_dim: int
) -> int:
    """4 * D * H FLOPs per visible (query, key) pair (QK^T and PV, 2 FLOPs per multiply-add)."""
    return 4 * head_dim * heads * visible_pairs(prefix_lens, chunk_lens)


# --------------------------------------------------------------------------------------------
# Inputs: paged pools with realistic fragmentation, contiguous views for SDPA, references
# --------------------------------------------------------------------------------------------
def paged_layout(
    lengths: Sequence[int], page_size: int, device
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Hand out pages for sequences of these lengths from a pool of exactly the pages needed,
    in the order of a random permutation (so consecutive pages of a sequence are scattered).

    Returns block_table int32 [B, W] (unused entries 0), slots int64 [sum(lengths)] (the flat
    pool slot of each token, sequences in order) and the number of pages in the pool."""
    pages = [-(-length // page_size) for length in lengths]
    width, num_pages = max(pages), sum(pages)
    perm = torch.randperm(num_pages, device=device)
    if len(set(lengths)) == 1:
        table = perm.view(len(lengths), width)
        positions = torch.arange(lengths[0], device=device)
        slots = table[:, positions // page_size] * page_size + positions % page_size
        return table.to(torch.int32), slots.reshape(-1), num_pages
    table = torch.zeros(len(lengths), width, dtype=torch.int64, device=device)
    slot_parts, offset = [], 0
    for b, (length, count) in enumerate(zip(lengths, pages)):
        table[b, :count] = perm[offset : offset + count]
        offset += count
        positions = torch.arange(length, device=device)
        slot_parts.append(table[b, positions // page_size] * page_size + positions % page_size)
    return table.to(torch.int32), torch.cat(slot_parts), num_pages


def build_paged_cache(
    k_tokens: torch.Tensor,  # [sum(lengths), Hkv, D], sequences in order
    v_tokens: torch.Tensor,  # [sum(lengths), Hkv, D]
    lengths: Sequence[int],
    page_size: int,
) -> dict:
    """The paged-op arguments holding these tokens: k_cache/v_cache [P, S, Hkv, D] (slots no
    token uses hold random values, never zeros), block_table, seq_lens."""
    device = k_tokens.device
    table, slots, num_pages = paged_layout(lengths, page_size, device)
    caches = []
    for tokens in (k_tokens, v_tokens):
        pool = torch.randn(
            num_pages * page_size, *tokens.shape[1:], dtype=tokens.dtype, device=device
        )
        pool[slots] = tokens
        caches.append(pool.view(num_pages, page_size, *tokens.shape[1:]))
    seq_lens = torch.tensor(list(lengths), dtype=torch.int32, device=device)
    return dict(k_cache=caches[0], v_cache=caches[1], block_table=table, seq_lens=seq_lens)


def query_start_loc(new_tokens: Sequence[int], device) -> torch.Tensor:
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def uniform_decode_call(
    batch: int, length: int, hq: int, hkv: int, head_dim: int, page_size: int = 16
) -> tuple:
    """One decode step over `batch` sequences of `length` cached tokens (bf16, random, in a
    shuffled paged pool): q [B, Hq, D] and the keyword arguments of torch.ops.astr.attention."""
    q = torch.randn(batch, hq, head_dim, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(batch * length, hkv, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn_like(k)
    cache = build_paged_cache(k, v, [length] * batch, page_size)
    cache["query_start_loc"] = query_start_loc([1] * batch, DEVICE)
    return q, dict(cache, max_query_len=1, mode="decode")


def reference_attention(
    q: torch.Tensor,  # [B, Hq, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    is_causal: bool = False,
    attn_mask: Optional[torch.Tensor] = None,  # bool [Lq, Lk], True = attend
) -> torch.Tensor:  # float32 [B, Hq, Lq, D]
    """Attention in float32 on upcast inputs, kv heads repeated for GQA, in chunks of batch and
    heads small enough that even the math kernel's Lq x Lk scores stay within the budget."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, hq, lq, head_dim = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    per_head = 4 * (lq * lk + 2 * lk * head_dim + 2 * lq * head_dim)
    head_step = max(1, min(hq, REFERENCE_BUDGET // per_head))
    batch_step = max(1, REFERENCE_BUDGET // (per_head * hq)) if head_step == hq else 1
    out = torch.empty(batch, hq, lq, head_dim, dtype=torch.float32, device=q.device)
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    for b0 in range(0, batch, batch_step):
        b1 = min(batch, b0 + batch_step)
        for h0 in range(0, hq, head_step):
            h1 = min(hq, h0 + head_step)
            kv_heads = torch.arange(h0, h1, device=q.device) // group
            qf = q[b0:b1, h0:h1].float()
            kf = k[b0:b1].index_select(1, kv_heads).float()
            vf = v[b0:b1].index_select(1, kv_heads).float()
            with sdpa_kernel(backends):
                out[b0:b1, h0:h1] = F.scaled_dot_product_attention(
                    qf, kf, vf, attn_mask=attn_mask, is_causal=is_causal
                )
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float().reshape(ref.shape)
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
FLUSH_MODES = {
    # A read of a 256 MB buffer (a sum) leaves L2 cold and clean: every line the timed call
    # needs comes from memory, and no line of the flush is left to be written back.
    "read": "256 MB read between runs (L2 cold and clean, outside the events)",
    # A write of 256 MB (until 2026-12-02, third session) leaves L2 full of dirty lines whose
    # write-back then runs inside the next timed call: measured on the H200, about 8 us more
    # for every peer alike (benchmarks/NOTES.md, "The flush").
    "write": "256 MB write between runs (L2 cold, full of dirty lines, outside the events)",
}


class Timer:
    """CUDA-event timing: warm-up, then ``repeats`` runs, each after a flush that evicts L2
    (FLUSH_MODES); the flush lies outside the events. Events are read after one final
    synchronize."""

    def __init__(self, warmup: int, repeats: int, flush_mode: str = "read"):
        self.warmup, self.repeats = warmup, repeats
        self.flush_mode = flush_mode
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=DEVICE)
        if flush_mode == "read" and DEVICE == "cuda":
            self.flush.fill_(1.0)  # defined values to read

    def evict(self, i: int) -> None:
        if self.flush_mode == "read":
            self.flush.sum()
        else:
            self.flush.fill_(float(i))

    def measure(self, fn: Callable, flush: bool = True, repeats: Optional[int] = None) -> dict:
        repeats = repeats or self.repeats
        for _ in range(self.warmup):
            fn()
        sync()
        if DEVICE == "cuda":
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(repeats)
            ]
            for i, (start, end) in enumerate(events):
                if flush:
                    self.evict(i)
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = sorted(start.elapsed_time(end) for start, end in events)
        else:  # the CPU smoke run of --selftest: host clock
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            times.sort()
        return dict(
            ms=times[len(times) // 2],
            min_ms=times[0],
            p10_ms=times[len(times) // 10],
            p90_ms=times[(9 * len(times)) // 10],
            repeats=repeats,
        )


def measure_ceilings(timer: Timer) -> dict:
    """Device-to-device copy of 4 GiB (bytes read + written) and a bf16 8192^3 matmul."""
    copy_bytes, copy_ms = _copy_ms(timer)
    free_cached()
    n, matmul_ms = _matmul_ms(timer)
    free_cached()
    return dict(
        copy_TBps=copy_bytes / ms_to_s(copy_ms) / 1e12,
        copy_bytes=copy_bytes,
        copy_ms=copy_ms,
        matmul_TFLOPs=2 * n**3 / ms_to_s(matmul_ms) / 1e12,
        matmul_ms=matmul_ms,
        matmul_shape=[n, n, n],
    )


def _copy_ms(timer: Timer) -> Tuple[int, float]:
    src = torch.empty(2 << 30, dtype=DTYPE, device=DEVICE).normal_()  # 4 GiB
    dst = torch.empty_like(src)
    timing = timer.measure(lambda: dst.copy_(src), flush=False, repeats=20)
    return 2 * src.numel() * ELEMENT_BYTES, timing["ms"]


def _matmul_ms(timer: Timer, n: int = 8192) -> Tuple[int, float]:
    a = torch.randn(n, n, dtype=DTYPE, device=DEVICE)
    b = torch.randn(n, n, dtype=DTYPE, device=DEVICE)
    return n, timer.measure(lambda: a @ b, flush=False, repeats=20)["ms"]


def ms_to_s(ms: float) -> float:
    return ms / 1e3


def median_round(samples_ms: Sequence[float], nbytes: int) -> Tuple[float, float]:
    """The A/B scripts' reading of one variant's per-round times: the upper median (ms) and the
    effective TB/s that `nbytes` moved in it."""
    median = sorted(samples_ms)[len(samples_ms) // 2]
    return median, nbytes / ms_to_s(median) / 1e12


# --------------------------------------------------------------------------------------------
# Running one peer on one shape
# --------------------------------------------------------------------------------------------
def short_error(error: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
    reasons = [" ".join(str(w.message).split())[:200] for w in caught]
    if reasons:
        text += " | warnings: " + " ; ".join(dict.fromkeys(reasons))[:400]
    return text


class Runner:
    """Runs peers, keeps the rows, and survives peers that raise."""

    def __init__(self, args, timer: Timer, ceilings: dict, astrai_error: str):
        self.args, self.timer, self.ceilings = args, timer, ceilings
        self.astrai_error = astrai_error
        self.broken = ""  # set when a CUDA error poisons the context: later peers are skipped

    def run(self, row: dict, make_fn: Callable[[], Callable], check: Callable, ref) -> dict:
        """make_fn() builds the timed callable; check(output) views its output like ref."""
        if self.broken:
            row["error"] = "skipped: " + self.broken
            return row
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn = make_fn()
                out = fn()
                sync()
                error = rel_l2(check(out), ref)
                row["rel_l2"] = error if math.isfinite(error) else str(error)
                row["verified"] = bool(math.isfinite(error) and error < VERIFY_TOLERANCE)
                del out
            except Exception as exc:  # a peer that cannot run this shape: record, go on
                row["error"] = short_error(exc, caught)
                self._check_context(row)
                return row
        if caught:
            row["warnings"] = list(
                dict.fromkeys(" ".join(str(w.message).split())[:200] for w in caught)
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                row.update(self.timer.measure(fn))
            except Exception as exc:
                row["error"] = short_error(exc)
                self._check_context(row)
        return row

    def _check_context(self, row: dict) -> None:
        try:
            sync()
        except Exception as exc:
            self.broken = f"CUDA context broken by {row['peer']} ({short_error(exc)[:120]})"
        free_cached()


def sdpa_callable(backend: Optional[str], call: Callable) -> Callable:
    if backend is None:
        return call
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = getattr(SDPBackend, backend)

    def fn():
        with sdpa_kernel([member]):
            return call()

    return fn


def astrai_callable(
    q: torch.Tensor, backend: str, cache: dict, explain: bool = True, **kw
) -> Callable:
    """torch.ops.astr.attention over the paged cache with backend=name; asks the resolver first
    (explain) so a refusal or a silent fallback is reported instead of timed."""
    kwargs = dict(cache, backend=backend, **kw)
    if explain:
        try:
            decision = json.loads(torch.ops.astr.explain(q, **kwargs))
        except Exception:  # explain is advisory; the call itself says what is wrong
            decision = None
        if decision is not None and decision.get("backend") != backend:
            raise RuntimeError(
                f"resolver chose {decision.get('backend')!r} for backend={backend!r}: "
                f"{decision.get('error') or decision.get('reasons')}"
            )
    return lambda: torch.ops.astr.attention(q, **kwargs)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------
def run_decode_shape(
    runner: Runner,
    peers: List[str],
    batch: int,
    length: int,
    hkv: int,
    hq: int = HQ,
    head_dim: int = HEAD_DIM,
) -> List[dict]:
    device = DEVICE
    q = torch.randn(batch, hq, head_dim, dtype=DTYPE, device=device)  # [T = B, Hq, D]
    k = torch.randn(batch, hkv, length, head_dim, dtype=DTYPE, device=device)  # SDPA layout
    v = torch.randn_like(k)
    q_sdpa = q.view(batch, hq, 1, head_dim)
    ref = reference_attention(q_sdpa, k, v).view(batch, hq, head_dim)
    nbytes = decode_bytes(batch, length, hq, hkv, head_dim)
    base = dict(kind="decode", B=batch, L=length, Hq=hq, Hkv=hkv, D=head_dim, bytes=nbytes)
    base["floor_us"] = nbytes / runner.ceilings["copy_TBps"] / 1e6
    rows = []
    page_peers = sorted((p for p in peers if p in ASTRAI_PEERS), key=lambda p: -ASTRAI_PEERS[p][1])
    cache, cache_page = None, None
    for peer in page_peers:
        backend, page_size = ASTRAI_PEERS[peer]
        row = dict(base, peer=peer, page_size=page_size)
        if runner.astrai_error:
            row["error"] = runner.astrai_error
            rows.append(row)
            report(row)
            continue
        if cache_page != page_size:
            cache = None
            free_cached()
            k_tokens = k.transpose(1, 2).reshape(batch * length, hkv, head_dim)
            v_tokens = v.transpose(1, 2).reshape(batch * length, hkv, head_dim)
            cache = build_paged_cache(k_tokens, v_tokens, [length] * batch, page_size)
            cache["query_start_loc"] = query_start_loc([1] * batch, device)
            del k_tokens, v_tokens
            cache_page = page_size

        def make(backend=backend, cache=cache):
            return astrai_callable(q, backend, cache, max_query_len=1, mode="decode")

        rows.append(runner.run(row, make, lambda out: out, ref))
        report(rows[-1])
    cache = None
    free_cached()
    for peer in (p for p in peers if p in SDPA_PEERS):
        row = dict(base, peer=peer)

        def make(peer=peer):
            call = lambda: F.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=hq != hkv)  # noqa: E731
            return sdpa_callable(SDPA_PEERS[peer], call)

        rows.append(runner.run(row, make, lambda out: out.view(batch, hq, head_dim), ref))
        report(rows[-1])
    for row in rows:
        if "ms" in row:
            row["TBps"] = nbytes / ms_to_s(row["ms"]) / 1e12
            row["pct_copy"] = 100 * row["TBps"] / runner.ceilings["copy_TBps"]
    return rows


# --------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------
def run_prefill_shape(
    runner: Runner, peers: List[str], batch: int, seq: int, hq: int, hkv: int, head_dim: int
) -> List[dict]:
    device = DEVICE
    tokens = batch * seq
    q_tokens = torch.randn(tokens, hq, head_dim, dtype=DTYPE, device=device)  # [T, Hq, D]
    k_tokens = torch.randn(tokens, hkv, head_dim, dtype=DTYPE, device=device)
    v_tokens = torch.randn_like(k_tokens)

    def bhsd(x):  # [T, H, D] -> contiguous [B, H, S, D], the anchors' layout
        return x.view(batch, seq, x.shape[1], head_dim).transpose(1, 2).contiguous()

    q, k, v = bhsd(q_tokens), bhsd(k_tokens), bhsd(v_tokens)
    ref = reference_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(tokens, hq, head_dim)
    flops = causal_prefill_flops(batch, hq, seq, head_dim)
    base = dict(kind="prefill", B=batch, S=seq, Hq=hq, Hkv=hkv, D=head_dim, flops=flops)
    rows = []
    astrai = [p for p in peers if p in ASTRAI_PEERS]
    rows += run_astrai_prefill(
        runner, astrai, base, q_tokens, k_tokens, v_tokens, [seq] * batch, [seq] * batch, ref
    )
    del k_tokens, v_tokens
    free_cached()
    for peer in (p for p in peers if p in SDPA_PEERS):
        row = dict(base, peer=peer)
        if peer == "sdpa_math" and seq > MATH_PREFILL_MAX_S:
            row["error"] = f"skipped: math materializes S x S scores (S > {MATH_PREFILL_MAX_S})"
            rows.append(row)
            report(row)
            continue

        def make(peer=peer):
            call = lambda: F.scaled_dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, enable_gqa=hq != hkv
            )
            return sdpa_callable(SDPA_PEERS[peer], call)

        rows.append(
            runner.run(
                row, make, lambda out: out.transpose(1, 2), ref.view(batch, seq, hq, head_dim)
            )
        )
        report(rows[-1])
    finish_prefill_rows(rows, runner)
    return rows


def run_astrai_prefill(runner, peers, base, q_tokens, k_tokens, v_tokens, lengths, new_tokens, ref):
    """The astrai peers over one paged prefill call: q [T, Hq, D]; the kv of every sequence
    (cached prefix + new tokens, already in the cache) in the pool."""
    rows = []
    cache, cache_page = None, None
    for peer in sorted(peers, key=lambda p: -ASTRAI_PEERS[p][1]):  # peers of one page size share
        backend, page_size = ASTRAI_PEERS[peer]
        row = dict(base, peer=peer, page_size=page_size)
        capacity = -(-max(lengths) // page_size) * page_size
        scores = len(lengths) * q_tokens.shape[1] * max(new_tokens) * capacity * ELEMENT_BYTES
        gqa = q_tokens.shape[1] != k_tokens.shape[1]
        if runner.astrai_error:
            row["error"] = runner.astrai_error
        elif peer == "torch_native" and gqa and scores > TORCH_NATIVE_GQA_SCORES_LIMIT:
            row["error"] = (
                f"skipped: masked GQA SDPA falls back to math, {scores / 1e9:.0f} GB of scores "
                f"(limit {TORCH_NATIVE_GQA_SCORES_LIMIT / 1e9:.0f} GB)"
            )
        if "error" in row:
            rows.append(row)
            report(row)
            continue
        if cache_page != page_size:
            cache = None
            free_cached()
            cache = build_paged_cache(k_tokens, v_tokens, lengths, page_size)
            cache["query_start_loc"] = query_start_loc(new_tokens, q_tokens.device)
            cache_page = page_size

        def make(backend=backend, cache=cache):
            return astrai_callable(
                q_tokens,
                backend,
                cache,
                max_query_len=max(new_tokens),
                mode="prefill",
                is_causal=True,
            )

        rows.append(runner.run(row, make, lambda out: out, ref))
        report(rows[-1])
    cache = None
    free_cached()
    return rows


def make_ragged_mix(seed: int, mix: dict = RAGGED) -> Tuple[List[int], List[int]]:
    generator = torch.Generator().manual_seed(seed)
    lo, hi = mix["prefix"]
    prefix = torch.randint(lo, hi + 1, (mix["batch"],), generator=generator).tolist()
    lo, hi = mix["chunk"]
    chunk = torch.randint(lo, hi + 1, (mix["batch"],), generator=generator).tolist()
    return prefix, chunk


def run_ragged_prefill(
    runner: Runner,
    peers: List[str],
    hq: int,
    hkv: int,
    seed: int,
    head_dim: int = HEAD_DIM,
    mix: dict = RAGGED,
) -> List[dict]:
    """Chunked prefill: sequences with cached prefixes of random lengths and new-token chunks of
    random lengths, all in one paged call. The SDPA peers loop over the sequences with an
    explicit bool mask (lower-right causal: new token i sees keys <= prefix + i); sdpa_default
    gets torch's causal_lower_right bias instead, which picks its own kernel."""
    device = DEVICE
    prefix, chunk = make_ragged_mix(seed, mix)
    lengths = [p + c for p, c in zip(prefix, chunk)]
    tokens = sum(chunk)
    q_tokens = torch.randn(tokens, hq, head_dim, dtype=DTYPE, device=device)
    k_tokens = torch.randn(sum(lengths), hkv, head_dim, dtype=DTYPE, device=device)
    v_tokens = torch.randn_like(k_tokens)
    seqs = []  # per sequence: q [1, Hq, c, D], k/v [1, Hkv, L, D], mask [c, L]
    q_off = kv_off = 0
    for p, c in zip(prefix, chunk):
        length = p + c
        per = [
            x[o : o + n].transpose(0, 1).unsqueeze(0).contiguous()
            for x, o, n in (
                (q_tokens, q_off, c),
                (k_tokens, kv_off, length),
                (v_tokens, kv_off, length),
            )
        ]
        mask = (
            torch.arange(length, device=device)[None, :]
            <= p + torch.arange(c, device=device)[:, None]
        )
        seqs.append((*per, mask))
        q_off, kv_off = q_off + c, kv_off + length
    ref = torch.cat(
        [reference_attention(qs, ks, vs, attn_mask=m)[0].transpose(0, 1) for qs, ks, vs, m in seqs]
    )  # [T, Hq, D]
    flops = ragged_prefill_flops(prefix, chunk, hq, head_dim)
    base = dict(
        kind="prefill",
        B=len(chunk),
        S="ragged",
        T=tokens,
        Hq=hq,
        Hkv=hkv,
        D=head_dim,
        flops=flops,
        prefix_lens=prefix,
        chunk_lens=chunk,
        max_kv_len=max(lengths),
    )
    rows = run_astrai_prefill(
        runner,
        [p for p in peers if p in ASTRAI_PEERS],
        base,
        q_tokens,
        k_tokens,
        v_tokens,
        lengths,
        chunk,
        ref,
    )
    del k_tokens, v_tokens
    free_cached()
    gqa = hq != hkv
    for peer in (p for p in peers if p in SDPA_PEERS):
        row = dict(base, peer=peer)
        if peer == "sdpa_default":
            from torch.nn.attention.bias import causal_lower_right

            biases = [causal_lower_right(qs.shape[2], ks.shape[2]) for qs, ks, _, _ in seqs]

            def make(biases=biases):
                return lambda: [
                    F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, enable_gqa=gqa)
                    for (qs, ks, vs, _), bias in zip(seqs, biases)
                ]

            row["mask"] = "causal_lower_right"
        else:

            def make(peer=peer):
                call = lambda: [  # noqa: E731
                    F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, enable_gqa=gqa)
                    for qs, ks, vs, m in seqs
                ]
                return sdpa_callable(SDPA_PEERS[peer], call)

            row["mask"] = "bool [c, L] per sequence"

        def check(outs):
            return torch.cat([o[0].transpose(0, 1) for o in outs])

        rows.append(runner.run(row, make, check, ref))
        report(rows[-1])
    finish_prefill_rows(rows, runner)
    return rows


def finish_prefill_rows(rows: List[dict], runner: Runner) -> None:
    for row in rows:
        if "ms" in row:
            row["TFLOPs"] = row["flops"] / ms_to_s(row["ms"]) / 1e12
            row["pct_matmul"] = 100 * row["TFLOPs"] / runner.ceilings["matmul_TFLOPs"]


# --------------------------------------------------------------------------------------------
# Progress lines
# --------------------------------------------------------------------------------------------
def shape_label(row: dict) -> str:
    if row["kind"] == "decode":
        return f"decode B={row['B']} L={row['L']} Hq={row['Hq']} Hkv={row['Hkv']} D={row['D']}"
    s = f"T={row['T']} (ragged)" if row["S"] == "ragged" else f"S={row['S']}"
    return f"prefill B={row['B']} {s} Hq={row['Hq']} Hkv={row['Hkv']} D={row['D']}"


def report(row: dict) -> None:
    head = f"{shape_label(row):50s} {row['peer']:15s}"
    if "error" in row:
        print(f"{head} ERROR {row['error'][:140]}", flush=True)
        return
    err = row.get("rel_l2")
    err_text = f"rel_l2 {err:.1e}" if isinstance(err, float) else f"rel_l2 {err}"
    flag = "" if row.get("verified") else "  MISMATCH"
    print(f"{head} {row['ms']:9.4f} ms  {err_text}{flag}", flush=True)


# --------------------------------------------------------------------------------------------
# Environment and outputs
# --------------------------------------------------------------------------------------------
def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "gpu"


def driver_version() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return (
            out.stdout.strip().splitlines()[0]
            if out.returncode == 0 and out.stdout.strip()
            else None
        )
    except Exception:
        return None


def collect_env(command: str, astrai_info: dict) -> dict:
    props = torch.cuda.get_device_properties(0)
    env = dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        compute_capability=list(torch.cuda.get_device_capability(0)),
        memory_GiB=round(props.total_memory / 2**30, 1),
        l2_MB=round(getattr(props, "L2_cache_size", 0) / 1e6, 1) or None,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        driver=driver_version(),
        python=platform.python_version(),
        command=command,
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    env.update(astrai_info)
    return env


def peer_columns(rows: List[dict], candidates: List[str]) -> List[str]:
    present = {r["peer"] for r in rows}
    return [p for p in candidates if p in present]


def fmt_cell(row: Optional[dict], value_key: str, pct_key: str, digits: int) -> str:
    if row is None:
        return ""
    if "error" in row:
        return "skip" if row["error"].startswith("skipped") else "err"
    mark = "" if row.get("verified") else " !"
    return f"{row[value_key]:.{digits}f} ({row[pct_key]:.0f}%){mark}"


def fmt_value(row: Optional[dict], value_key: str, digits: int) -> str:
    if row is None:
        return ""
    if "error" in row:
        return "skip" if row["error"].startswith("skipped") else "err"
    return f"{row[value_key]:.{digits}f}" + ("" if row.get("verified") else " !")


def index_rows(rows: List[dict]) -> Dict[tuple, Dict[str, dict]]:
    table: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        key = (r["kind"], r["B"], r.get("L"), r.get("S"), r["Hq"], r["Hkv"], r["D"])
        table.setdefault(key, {})[r["peer"]] = r
    return table


def render_markdown(result: dict) -> str:
    env, ceil = result["env"], result["ceilings"]
    build = env.get("astrai_build") or {}
    rows = result["rows"]
    lines = [
        f"# astrai attention benchmark: {env['gpu']}, {env['date'][:10]}",
        "",
        f"Command: `{env['command']}`",
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env.get('cudnn')}, driver "
        f"{env.get('driver')}, {env['sms']} SMs; astrai library built for torch "
        f"{build.get('torch_version', '?')}, archs {build.get('cuda_archs', '?')}.",
        "",
        f"Ceilings measured in this run: device-to-device copy **{ceil['copy_TBps']:.2f} TB/s** "
        f"(read + written), bf16 8192^3 matmul **{ceil['matmul_TFLOPs']:.0f} TFLOP/s** "
        f"(anchors: {ANCHOR_CEILINGS['copy_TBps']:.2f} TB/s, "
        f"{ANCHOR_CEILINGS['matmul_TFLOPs']:.0f} TFLOP/s).",
        "",
        f"Timing: {result.get('method', {}).get('timing', '?')}.",
        "",
        "Cells: value (% of this run's ceiling); `!` = output differs from the float32 "
        f"reference by more than {VERIFY_TOLERANCE:g} rel L2; `err` = the peer raised (see "
        f"Errors); `skip` = not run by design. `anchor *` = SDPA on {ANCHOR_SOURCE}.",
        "",
    ]
    sets = result["sets"]
    table = index_rows(rows)

    decode_rows = [r for r in rows if r["kind"] == "decode"]
    if decode_rows:
        peers = peer_columns(decode_rows, DECODE_PEERS)
        lines += [
            "## Decode: effective TB/s (% of copy)",
            "",
            "One query token per sequence, D=128, Hq=32; K/V pages from a shuffled pool (astrai), "
            "contiguous [B, H, L, D] (SDPA). Bytes = K+V of the live tokens + q + output; "
            "`floor us` = those bytes at the copy ceiling.",
            "",
        ]
        head = (
            ["B", "Hkv", "L", "floor us"] + peers + [f"anchor {c}" for c in ANCHOR_DECODE_COLUMNS]
        )
        lines += [md_row(head), md_row(["---"] * len(head))]
        for key in sets.get("decode", []):
            cells = table.get(tuple(key), {})
            any_row = next(iter(cells.values()), None)
            if any_row is None:
                continue
            anchor = ANCHOR_DECODE.get(
                (any_row["B"], any_row["Hq"], any_row["Hkv"], any_row["L"], any_row["D"]), {}
            )
            lines.append(
                md_row(
                    [any_row["B"], any_row["Hkv"], any_row["L"], f"{any_row['floor_us']:.1f}"]
                    + [fmt_cell(cells.get(p), "TBps", "pct_copy", 2) for p in peers]
                    + [anchor.get(c, "-") if anchor else "" for c in ANCHOR_DECODE_COLUMNS]
                )
            )
        sweep = sets.get("decode_sweep", [])
        if sweep:
            lines += ["", f"Context sweep (B={DECODE_SWEEP_B}, Hkv=8), TB/s:", ""]
            head = ["L"] + peers
            lines += [md_row(head), md_row(["---"] * len(head))]
            for key in sweep:
                cells = table.get(tuple(key), {})
                if cells:
                    length = next(iter(cells.values()))["L"]
                    lines.append(
                        md_row([length] + [fmt_value(cells.get(p), "TBps", 2) for p in peers])
                    )
        lines.append("")

    prefill_rows = [r for r in rows if r["kind"] == "prefill"]
    if prefill_rows:
        peers = peer_columns(prefill_rows, PREFILL_PEERS)
        lines += [
            "## Prefill: TFLOP/s (% of matmul)",
            "",
            "Causal, bf16; FLOPs = 2*B*H*S*S*D (square); ragged rows count the visible "
            "(query, key) pairs * 4*D*H. astrai: one paged call (page 16, shuffled pool); SDPA: "
            "contiguous [B, H, S, D]. Anchors exist for the MHA rows.",
            "",
        ]
        head = (
            ["B", "Hq", "Hkv", "S", "D"] + peers + [f"anchor {c}" for c in ANCHOR_PREFILL_COLUMNS]
        )
        lines += [md_row(head), md_row(["---"] * len(head))]
        for key in sets.get("prefill", []):
            cells = table.get(tuple(key), {})
            r0 = next(iter(cells.values()), None)
            if r0 is None:
                continue
            anchor = {}
            if r0["Hq"] == r0["Hkv"] and r0["S"] != "ragged":
                anchor = ANCHOR_PREFILL.get((r0["B"], r0["Hq"], r0["S"], r0["D"]), {})
            s_text = (
                f"ragged T={r0['T']}, kv<={r0['max_kv_len']}" if r0["S"] == "ragged" else r0["S"]
            )
            lines.append(
                md_row(
                    [r0["B"], r0["Hq"], r0["Hkv"], s_text, r0["D"]]
                    + [fmt_cell(cells.get(p), "TFLOPs", "pct_matmul", 0) for p in peers]
                    + [anchor.get(c, "-") if anchor else "" for c in ANCHOR_PREFILL_COLUMNS]
                )
            )
        sweep = sets.get("prefill_sweep", [])
        if sweep:
            lines += [
                "",
                f"Sequence sweep (B=1, Hq=32, Hkv={32 // GQA_GROUP}, D=128), TFLOP/s:",
                "",
            ]
            head = ["S"] + peers
            lines += [md_row(head), md_row(["---"] * len(head))]
            for key in sweep:
                cells = table.get(tuple(key), {})
                if cells:
                    seq = next(iter(cells.values()))["S"]
                    lines.append(
                        md_row([seq] + [fmt_value(cells.get(p), "TFLOPs", 0) for p in peers])
                    )
        ragged = [r for r in prefill_rows if r["S"] == "ragged"]
        if ragged:
            r0 = ragged[0]
            lines += [
                "",
                f"Ragged mix: prefixes {r0['prefix_lens']}, chunks {r0['chunk_lens']}; SDPA peers "
                "loop over sequences with a bool lower-right causal mask, sdpa_default with "
                "torch's causal_lower_right bias.",
            ]
        lines.append("")

    verified = [r for r in rows if "rel_l2" in r]
    if verified:
        lines += ["## Verification (rel L2 vs float32 reference, worst shape per peer)", ""]
        worst: Dict[str, dict] = {}
        for r in verified:
            value = r["rel_l2"] if isinstance(r["rel_l2"], float) else float("inf")
            if r["peer"] not in worst or value > worst[r["peer"]]["value"]:
                worst[r["peer"]] = dict(value=value, row=r)
        lines += [
            md_row(["peer", "worst rel L2", "at", "all within tolerance"]),
            md_row(["---"] * 4),
        ]
        for peer, w in worst.items():
            ok = all(r.get("verified") for r in verified if r["peer"] == peer)
            lines.append(
                md_row([peer, f"{w['value']:.2e}", shape_label(w["row"]), "yes" if ok else "NO"])
            )
        lines.append("")

    errors = [r for r in rows if "error" in r and not r["error"].startswith("skipped: math")]
    if result.get("shape_errors") or result.get("notes"):
        lines += ["## Shapes that failed before any peer ran, and notes", ""]
        lines += [f"- {e['shape']}: {e['error']}" for e in result.get("shape_errors", [])]
        lines += [f"- {note}" for note in result.get("notes", [])]
        lines.append("")
    if errors:
        lines += ["## Errors (first shape per peer and message)", ""]
        seen = set()
        for r in errors:
            key = (r["peer"], r["error"][:80])
            if key in seen:
                continue
            seen.add(key)
            count = sum(1 for e in errors if (e["peer"], e["error"][:80]) == key)
            message = r["error"][:300].replace("|", "/")
            lines.append(f"- `{r['peer']}` at {shape_label(r)} ({count} shape(s)): {message}")
        lines.append("")
    lines.append(
        f"Elapsed {result.get('elapsed_s', 0):.0f} s; "
        f"peak GPU memory {result.get('peak_memory_GB', 0):.1f} GB."
    )
    return "\n".join(lines) + "\n"


def md_row(cells: Sequence) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render_plots(result: dict, out_dir: str) -> List[str]:
    """decode_tbps.png and prefill_tflops.png from the sweep sets; returns the files written
    (none, with a note in result['notes'], when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        result.setdefault("notes", []).append(f"plots skipped: matplotlib unavailable ({exc})")
        return []
    table = index_rows(result["rows"])
    written = []
    specs = [
        ("decode_sweep", DECODE_PEERS, "L", "TBps", "copy_TBps", "copy ceiling", "decode_tbps.png"),
        (
            "prefill_sweep",
            PREFILL_PEERS,
            "S",
            "TFLOPs",
            "matmul_TFLOPs",
            "matmul ceiling",
            "prefill_tflops.png",
        ),
    ]
    for set_name, peers, x_key, y_key, ceil_key, ceil_label, file_name in specs:
        keys = result["sets"].get(set_name, [])
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
        xs_all = []
        for peer in peers:
            points = []
            for key in keys:
                row = table.get(tuple(key), {}).get(peer)
                if row is not None and y_key in row:
                    points.append((row[x_key], row[y_key]))
                if row is not None:
                    xs_all.append(row[x_key])
            if points:
                style = "-o" if peer in ASTRAI_PEERS else "--s"
                ax.plot(
                    [p[0] for p in points], [p[1] for p in points], style, label=peer, markersize=4
                )
        ceiling = result["ceilings"][ceil_key]
        ax.axhline(
            ceiling, color="black", linestyle="--", linewidth=1, label=f"{ceil_label} {ceiling:.3g}"
        )
        ax.set_xscale("log", base=2)
        if xs_all:
            ticks = sorted(set(xs_all))
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
        ax.set_ylim(0, 1.1 * max(max(line.get_ydata()) for line in ax.lines))
        env = result["env"]
        if set_name == "decode_sweep":
            ax.set_xlabel("context length L (tokens)")
            ax.set_ylabel("effective TB/s (K+V+q+out bytes / time)")
            ax.set_title(f"Decode, B={DECODE_SWEEP_B}, Hq=32, Hkv=8, D=128, bf16 - {env['gpu']}")
        else:
            ax.set_xlabel("sequence length S (tokens)")
            ax.set_ylabel("TFLOP/s (2*B*H*S*S*D / time)")
            ax.set_title(
                f"Causal prefill, B=1, Hq=32, Hkv={32 // GQA_GROUP}, D=128, bf16 - {env['gpu']}"
            )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.text(0.01, 0.01, env["command"], fontsize=6, color="gray")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(out_dir, file_name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def output_stem(result: dict) -> str:
    return f"bench_{safe_name(result['env']['gpu'])}_{result['env']['date'][:10]}"


def write_json(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, output_stem(result) + ".json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, allow_nan=False, default=str)
    os.replace(tmp, path)
    return path


def write_outputs(result: dict, out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    plots = render_plots(result, out_dir)
    md_path = os.path.join(out_dir, output_stem(result) + ".md")
    with open(md_path, "w") as f:
        f.write(render_markdown(result))
    json_path = write_json(result, out_dir)
    return [json_path, md_path] + plots


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def select_peers(spec: Optional[str]) -> List[str]:
    if not spec:
        return list(ALL_PEERS)
    chosen: List[str] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if token in PEER_GROUPS:
            chosen += PEER_GROUPS[token]
        elif token in ALL_PEERS:
            chosen.append(token)
        else:
            raise ValueError(
                f"--backends: unknown peer {token!r} (peers: {', '.join(ALL_PEERS)}; groups: "
                f"{', '.join(PEER_GROUPS)})"
            )
    return [p for p in ALL_PEERS if p in chosen]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=SCRIPT,
        description="astrai attention (paged cuda / torch_native / flash) against torch SDPA "
        "backends: decode TB/s and causal prefill TFLOP/s, with copy and matmul ceilings "
        "measured in the same run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="peers: "
        + ", ".join(ALL_PEERS)
        + "\ngroups: "
        + ", ".join(f"{g} = {'+'.join(p)}" for g, p in PEER_GROUPS.items()),
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats (< 3 min)")
    parser.add_argument("--only", choices=["decode", "prefill"], help="run one half only")
    parser.add_argument(
        "--backends",
        metavar="LIST",
        help="comma-separated peers or groups (default: all), e.g. cuda,torch_native,sdpa_cudnn",
    )
    parser.add_argument(
        "--out",
        default=os.path.join(ROOT, "benchmarks", "results"),
        help="output folder (default: benchmarks/results)",
    )
    parser.add_argument("--repeats", type=int, help="timed runs per peer (default 30; --quick 20)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default 5; --quick 3)")
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed (inputs, page order, ragged mix)"
    )
    parser.add_argument(
        "--flush",
        choices=sorted(FLUSH_MODES),
        default="read",
        help="how L2 is emptied before each timed run: read (default; cold, clean) or write "
        "(cold, dirty: the flush's write-back lands in the timed call, as before 2026-12-02)",
    )
    parser.add_argument(
        "--selftest",
        action="store_true",
        help="no GPU: check the byte/FLOP counting and the paged layout on the CPU, and render the "
        "markdown, JSON and plots from synthetic rows into a temporary folder",
    )
    args = parser.parse_args(argv)
    try:
        args.peers = select_peers(args.backends)
    except ValueError as exc:
        parser.error(str(exc))
    args.repeats = args.repeats or (20 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    if args.repeats < 1:
        parser.error("--repeats: must be at least 1")
    return args


def reproduce_command(argv: Sequence[str]) -> str:
    return " ".join(["python3", SCRIPT] + [shlex.quote(a) for a in argv])


def load_astrai() -> Tuple[str, dict]:
    """Import astrai's library; an import failure becomes the error of every astrai peer."""
    try:
        import astrai.extension  # noqa: F401  (loads the library, registers the ops)

        info = {"astrai_build": json.loads(torch.ops.astr.build_info())}
    except Exception as exc:
        return f"astrai not importable: {short_error(exc)}", {"astrai_build": {}}
    try:
        from astrai.extension.backend.flash import probe_flash

        info["flash_probe"] = probe_flash().reason
    except Exception as exc:
        info["flash_probe"] = f"probe failed: {short_error(exc)}"
    return "", info


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.selftest:
        return selftest()
    command = reproduce_command(argv)
    print(f"command: {command}", flush=True)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device visible; it times GPU kernels (try --selftest)")
        return 2
    started = time.time()
    torch.manual_seed(args.seed)
    astrai_error, astrai_info = load_astrai()
    if astrai_error:
        print(astrai_error, flush=True)
    result = dict(
        env=collect_env(command, astrai_info),
        method=dict(
            timing=f"CUDA events, {args.warmup} warm-up, median of {args.repeats}, "
            f"{FLUSH_MODES[args.flush]}",
            verify=f"first output vs float32 reference (rel L2, tolerance {VERIFY_TOLERANCE:g})",
            decode_bytes="2*B*L*Hkv*D*2 (K+V) + 2*B*Hq*D*2 (q + out)",
            prefill_flops="2*B*Hq*S*S*D causal square; ragged: 4*D*Hq*visible pairs",
            anchors=ANCHOR_SOURCE,
        ),
        args=dict(
            quick=args.quick,
            only=args.only,
            peers=args.peers,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
        ),
        anchor_ceilings=ANCHOR_CEILINGS,
        rows=[],
        sets={},
    )
    print(json.dumps(result["env"]), flush=True)
    timer = Timer(args.warmup, args.repeats, args.flush)
    result["ceilings"] = measure_ceilings(timer)
    c = result["ceilings"]
    print(
        f"ceilings: copy {c['copy_TBps']:.2f} TB/s, matmul {c['matmul_TFLOPs']:.0f} TFLOP/s",
        flush=True,
    )
    runner = Runner(args, timer, result["ceilings"], astrai_error)
    quick_flag = " --quick" if args.quick else ""
    done: Dict[tuple, List[dict]] = {}

    def measure(set_name: str, key: tuple, run: Callable[[], List[dict]]) -> None:
        if key not in done:
            try:
                rows = run()
            except Exception as exc:  # inputs or reference failed (e.g. out of memory): go on
                rows = []
                message = short_error(exc)
                result.setdefault("shape_errors", []).append(dict(shape=list(key), error=message))
                print(f"{key}: shape failed: {message}", flush=True)
                runner._check_context(dict(peer="inputs/reference"))
            free_cached()  # the shape's tensors died with run()
            for row in rows:
                row["cmd"] = (
                    f"python3 {SCRIPT}{quick_flag} --only {row['kind']} --backends {row['peer']}"
                )
            done[key] = rows
            result["rows"] += rows
        for row in done[key]:
            row.setdefault("sets", [])
            if set_name not in row["sets"]:
                row["sets"].append(set_name)
        result["sets"].setdefault(set_name, [])
        if list(key) not in result["sets"][set_name]:
            result["sets"][set_name].append(list(key))
        result["elapsed_s"] = time.time() - started
        write_json(result, args.out)  # partial results survive a crash

    def decode_key(b, length, hkv):
        return ("decode", b, length, None, HQ, hkv, HEAD_DIM)

    def prefill_key(b, s, h, hkv, d):
        return ("prefill", b, None, s, h, hkv, d)

    decode_peers = [p for p in args.peers if p in DECODE_PEERS]
    if args.only in (None, "decode") and decode_peers:
        for b, length, hkv in DECODE_SHAPES:
            run = partial(run_decode_shape, runner, decode_peers, b, length, hkv)
            measure("decode", decode_key(b, length, hkv), run)
        for length in DECODE_SWEEP_L_QUICK if args.quick else DECODE_SWEEP_L:
            run = partial(run_decode_shape, runner, decode_peers, DECODE_SWEEP_B, length, HKV)
            measure("decode_sweep", decode_key(DECODE_SWEEP_B, length, HKV), run)
    prefill_peers = [p for p in args.peers if p in PREFILL_PEERS]
    if args.only in (None, "prefill") and prefill_peers:
        for b, s, h, d in PREFILL_SHAPES_QUICK if args.quick else PREFILL_SHAPES:
            for hkv in (h // GQA_GROUP, h):
                run = partial(run_prefill_shape, runner, prefill_peers, b, s, h, hkv, d)
                measure("prefill", prefill_key(b, s, h, hkv, d), run)
        for hkv in (HQ // GQA_GROUP, HQ):
            run = partial(run_ragged_prefill, runner, prefill_peers, HQ, hkv, args.seed)
            measure("prefill", prefill_key(RAGGED["batch"], "ragged", HQ, hkv, HEAD_DIM), run)
        for s in PREFILL_SWEEP_S_QUICK if args.quick else PREFILL_SWEEP_S:
            run = partial(run_prefill_shape, runner, prefill_peers, 1, s, HQ, HKV, HEAD_DIM)
            measure("prefill_sweep", prefill_key(1, s, HQ, HKV, HEAD_DIM), run)
    result["elapsed_s"] = time.time() - started
    result["peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
    if runner.broken:
        result.setdefault("notes", []).append(runner.broken)
    files = write_outputs(result, args.out)
    print()
    print(render_markdown(result))
    print("wrote:", *files, sep="\n  ")
    print(f"command: {command}")
    return 0


# --------------------------------------------------------------------------------------------
# Self-test (CPU): counting, layout, and report writing from synthetic rows
# --------------------------------------------------------------------------------------------
def synthetic_result(quick: bool = False) -> dict:
    """A result set shaped like a real run, with made-up timings, errors and a mismatch."""
    ceilings = dict(copy_TBps=4.2, matmul_TFLOPs=750.0)
    rows: List[dict] = []
    sets: Dict[str, list] = {}
    gen = torch.Generator().manual_seed(1)

    def jitter():
        return 0.8 + 0.4 * float(torch.rand((), generator=gen))

    def add_decode(set_name, b, length, hkv):
        key = ["decode", b, length, None, HQ, hkv, HEAD_DIM]
        sets.setdefault(set_name, []).append(key)
        if any(
            r["kind"] == "decode" and r["B"] == b and r["L"] == length and r["Hkv"] == hkv
            for r in rows
        ):
            return
        nbytes = decode_bytes(b, length, HQ, hkv, HEAD_DIM)
        for peer, tbps in zip(DECODE_PEERS, [3.6, 3.0, 1.2, None, 2.6, None, 3.3, 0.09, 3.2]):
            row = dict(
                kind="decode",
                B=b,
                L=length,
                Hq=HQ,
                Hkv=hkv,
                D=HEAD_DIM,
                bytes=nbytes,
                peer=peer,
                floor_us=nbytes / ceilings["copy_TBps"] / 1e6,
                sets=[set_name],
            )
            if tbps is None:
                row["error"] = (
                    "RuntimeError: No available kernel. Aborting execution. | warnings: "
                    "Both fused kernels do not support non-null attn_mask"
                )
            else:
                t = min(tbps * jitter() * min(1.0, length / 4096) ** 0.3, 4.1)
                row.update(ms=nbytes / t / 1e9, rel_l2=3e-3, verified=True)
                row["TBps"] = nbytes / ms_to_s(row["ms"]) / 1e12
                row["pct_copy"] = 100 * row["TBps"] / ceilings["copy_TBps"]
            rows.append(row)

    def add_prefill(set_name, b, s, h, hkv, d, prefix=None, chunk=None):
        key = ["prefill", b, None, s, h, hkv, d]
        sets.setdefault(set_name, []).append(key)
        if s == "ragged":
            flops = ragged_prefill_flops(prefix, chunk, h, d)
        else:
            flops = causal_prefill_flops(b, h, s, d)
        for peer, tf in zip(PREFILL_PEERS, [420, 300, None, 290, 150, 560, 10, 520]):
            row = dict(
                kind="prefill",
                B=b,
                S=s,
                Hq=h,
                Hkv=hkv,
                D=d,
                flops=flops,
                peer=peer,
                sets=[set_name],
            )
            if s == "ragged":
                row.update(
                    T=sum(chunk),
                    prefix_lens=prefix,
                    chunk_lens=chunk,
                    max_kv_len=max(p + c for p, c in zip(prefix, chunk)),
                )
            if tf is None:
                row["error"] = (
                    "RuntimeError: resolver chose None for backend='flash': flash-attn missing"
                )
            elif peer == "sdpa_math" and s != "ragged" and s > MATH_PREFILL_MAX_S:
                row["error"] = f"skipped: math materializes S x S scores (S > {MATH_PREFILL_MAX_S})"
            else:
                t = tf * jitter()
                row.update(ms=flops / t / 1e9, rel_l2=4e-3 if peer != "torch_native" else 5e-2)
                row["verified"] = row["rel_l2"] < VERIFY_TOLERANCE
                row["TFLOPs"] = flops / ms_to_s(row["ms"]) / 1e12
                row["pct_matmul"] = 100 * row["TFLOPs"] / ceilings["matmul_TFLOPs"]
            rows.append(row)

    for b, length, hkv in DECODE_SHAPES:
        add_decode("decode", b, length, hkv)
    for length in DECODE_SWEEP_L_QUICK if quick else DECODE_SWEEP_L:
        add_decode("decode_sweep", DECODE_SWEEP_B, length, HKV)
    for b, s, h, d in PREFILL_SHAPES:
        for hkv in (h // GQA_GROUP, h):
            add_prefill("prefill", b, s, h, hkv, d)
    prefix, chunk = make_ragged_mix(0)
    add_prefill("prefill", RAGGED["batch"], "ragged", HQ, HKV, HEAD_DIM, prefix, chunk)
    for s in PREFILL_SWEEP_S:
        add_prefill("prefill_sweep", 1, s, HQ, HKV, HEAD_DIM)
    env = dict(
        gpu="NVIDIA H200 (synthetic)",
        sms=132,
        compute_capability=[9, 0],
        torch=torch.__version__,
        cuda="13.0",
        cudnn=91000,
        driver="580.00",
        python=platform.python_version(),
        command=f"python3 {SCRIPT} --selftest",
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        astrai_build={"torch_version": torch.__version__, "cuda_archs": "9.0"},
    )
    return dict(
        env=env,
        ceilings=ceilings,
        rows=rows,
        sets=sets,
        elapsed_s=1.0,
        peak_memory_GB=0.0,
        anchor_ceilings=ANCHOR_CEILINGS,
    )


def cpu_smoke_run(expect: Callable[[bool, str], None]) -> None:
    """The GPU code paths at toy sizes on the CPU: torch_native and SDPA math/default must run
    and match the reference; peers that cannot run must end as error strings."""
    global DEVICE
    astrai_error, _ = load_astrai()
    print(f"cpu smoke run: astrai {'unavailable: ' + astrai_error if astrai_error else 'loaded'}")
    DEVICE, saved = "cpu", DEVICE
    try:
        torch.manual_seed(0)
        timer = Timer(warmup=1, repeats=3)
        timer.flush = torch.empty(0)
        runner = Runner(None, timer, dict(copy_TBps=4.2, matmul_TFLOPs=750.0), astrai_error)
        rows = run_decode_shape(runner, DECODE_PEERS, 3, 40, 2, hq=4, head_dim=16)
        rows += run_prefill_shape(runner, PREFILL_PEERS, 2, 40, 4, 2, 16)
        mix = dict(batch=3, prefix=(0, 30), chunk=(1, 20))
        rows += run_ragged_prefill(runner, PREFILL_PEERS, 4, 2, 0, head_dim=16, mix=mix)
    finally:
        DEVICE = saved
    by_peer: Dict[str, List[dict]] = {}
    for row in rows:
        by_peer.setdefault(row["peer"], []).append(row)
    must_run = ["sdpa_math", "sdpa_default"] + ([] if astrai_error else ["torch_native"])
    for peer in must_run:
        ok = all("ms" in r and r.get("verified") for r in by_peer[peer])
        expect(
            ok,
            f"cpu smoke: {peer} ran and matched the reference on all {len(by_peer[peer])} shapes",
        )
    ok = all(("ms" in r and r.get("verified")) or r.get("error") for r in rows)
    expect(ok, "cpu smoke: every row either verified or carries an error string")
    ok = all("TBps" in r for r in rows if r["kind"] == "decode" and "ms" in r) and all(
        "TFLOPs" in r for r in rows if r["kind"] == "prefill" and "ms" in r
    )
    expect(ok, "cpu smoke: rates computed for every timed row")


def selftest() -> int:
    failures: List[str] = []

    def expect(cond: bool, what: str) -> None:
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    # Counting against the anchors' numbers.
    for (b, hq, hkv, length, d), floor in ANCHOR_DECODE_FLOOR_US.items():
        us = decode_bytes(b, length, hq, hkv, d) / ANCHOR_CEILINGS["copy_TBps"] / 1e6
        expect(
            abs(us - floor) < 0.051,
            f"decode floor B={b} L={length} Hkv={hkv}: {us:.2f} us vs anchor {floor}",
        )
    for b, h, s, d in PREFILL_SHAPES:
        expect(
            causal_prefill_flops(b, h, s, d) == 4 * b * h * s * s * d // 2,
            f"causal FLOPs B={b} S={s}",
        )
    expect(
        decode_bytes(16, 4096, 32, 8, 128) == 2 * 16 * 4096 * 8 * 128 * 2 + 2 * 16 * 32 * 128 * 2,
        "decode bytes B=16 L=4096",
    )
    # Visible pairs against a brute-force count of the lower-right causal mask.
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 50, (6,), generator=gen).tolist()
    chunk = torch.randint(1, 40, (6,), generator=gen).tolist()
    brute = sum(
        int((torch.arange(p + c)[None, :] <= p + torch.arange(c)[:, None]).sum())
        for p, c in zip(prefix, chunk)
    )
    expect(
        visible_pairs(prefix, chunk) == brute,
        f"ragged visible pairs {visible_pairs(prefix, chunk)} == {brute}",
    )
    expect(visible_pairs([0], [8]) == 36, "square causal S=8: 36 pairs (S(S+1)/2)")
    expect(
        ragged_prefill_flops([0, 5], [4, 3], 2, 16) == 4 * 16 * 2 * (10 + 3 * 5 + 6), "ragged FLOPs"
    )
    prefix, chunk = make_ragged_mix(0)
    expect(
        len(prefix) == RAGGED["batch"]
        and all(0 <= p <= 4096 for p in prefix)
        and all(256 <= c <= 2048 for c in chunk),
        f"ragged mix prefixes {prefix} chunks {chunk}",
    )
    # Paged layout round trip on the CPU (uniform and ragged lengths, page sizes 1 and 16).
    torch.manual_seed(0)
    for lengths in ([48, 48, 48], [5, 33, 16, 1]):
        for page in (1, 16):
            k_tokens = torch.randn(sum(lengths), 2, 4)
            v_tokens = torch.randn(sum(lengths), 2, 4)
            cache = build_paged_cache(k_tokens, v_tokens, lengths, page)
            table, kc, vc = cache["block_table"], cache["k_cache"], cache["v_cache"]
            ok = table.dtype == torch.int32 and kc.shape[1] == page
            used = set()
            offset = 0
            for b, length in enumerate(lengths):
                pos = torch.arange(length)
                pages = table[b, pos // page].long()
                ok &= torch.equal(kc[pages, pos % page], k_tokens[offset : offset + length])
                ok &= torch.equal(vc[pages, pos % page], v_tokens[offset : offset + length])
                used |= set(table[b, : -(-length // page)].tolist())
                offset += length
            ok &= len(used) == kc.shape[0] and torch.equal(
                cache["seq_lens"], torch.tensor(lengths, dtype=torch.int32)
            )
            expect(
                bool(ok),
                f"paged layout lengths={lengths} page={page}: tokens read back through block_table",
            )
    expect(
        torch.equal(
            query_start_loc([3, 1, 2], "cpu"), torch.tensor([0, 3, 4, 6], dtype=torch.int32)
        ),
        "query_start_loc prefix sums",
    )
    # Reference (float32 SDPA) against a direct softmax, GQA + mask, on the CPU.
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.arange(7)[None, :] <= 2 + torch.arange(5)[:, None]
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = (q @ kr.transpose(-1, -2)) / math.sqrt(8)
    direct = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vr
    expect(
        rel_l2(reference_attention(q, k, v, attn_mask=mask), direct) < 1e-5,
        "reference attention (GQA, mask)",
    )
    # The GPU code paths, run small on the CPU (torch_native and SDPA run; the rest must fail
    # cleanly into error strings).
    cpu_smoke_run(expect)
    # CLI.
    args = parse_args(
        ["--quick", "--only", "decode", "--backends", "cuda,sdpa_cudnn", "--out", "/tmp/x"]
    )
    expect(
        args.peers == ["cuda_ps16", "cuda_ps1", "sdpa_cudnn"]
        and args.repeats == 20
        and args.warmup == 3,
        f"--backends cuda,sdpa_cudnn -> {args.peers}",
    )
    expect(parse_args([]).repeats == 30, "full run: 30 repeats")
    expect(
        reproduce_command(["--quick", "--out", "a b"]) == f"python3 {SCRIPT} --quick --out 'a b'",
        "reproduce command quotes arguments",
    )
    expect(
        safe_name("NVIDIA H200 (synthetic)") == "NVIDIA-H200-synthetic", "file-name-safe GPU name"
    )
    # Report writing from synthetic rows.
    out_dir = tempfile.mkdtemp(prefix="bench_attention_selftest_")
    result = synthetic_result()
    files = write_outputs(result, out_dir)
    names = sorted(os.listdir(out_dir))
    expect(all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names), f"file names {names}")
    stem = output_stem(result)
    expect(f"{stem}.json" in names and f"{stem}.md" in names, "json and md written")
    with open(os.path.join(out_dir, f"{stem}.json")) as f:
        loaded = json.load(f)
    expect(len(loaded["rows"]) == len(result["rows"]), "json round trip")
    with open(os.path.join(out_dir, f"{stem}.md")) as f:
        markdown = f.read()
    expect(
        "## Decode" in markdown and "## Prefill" in markdown and "anchor cudnn" in markdown,
        "markdown tables",
    )
    expect("2.95" in markdown and "554.2" in markdown, "anchor numbers in the tables")
    expect("NO" in markdown, "verification table flags the synthetic mismatch")
    plots = [f for f in files if f.endswith(".png")]
    if "notes" in result:
        print("note:", *result["notes"])
    else:
        expect(
            sorted(os.path.basename(p) for p in plots) == ["decode_tbps.png", "prefill_tflops.png"],
            "plots",
        )
    print(f"\nselftest outputs in {out_dir}:")
    for name in names:
        print(f"  {name} ({os.path.getsize(os.path.join(out_dir, name))} bytes)")
    print("\n" + markdown)
    print(
        f"selftest: {len(failures)} failure(s)" + (": " + "; ".join(failures) if failures else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
