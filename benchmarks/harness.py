"""How the attention benchmark measures: counting bytes and FLOPs, the inputs (a paged pool with
its pages scattered, the same values as contiguous tensors), the reference, CUDA-event timing with
L2 emptied before each run, the copy and matmul ceilings, and a runner that survives peers that
raise. Nothing here knows a peer; bench_attention.py (the driver) and the other bench_*.py use it.

Every function takes its device (default "cuda"); on "cpu" the timer reads the host clock and
flushes nothing, which is what the CPU tests in tests/benchmarks/ exercise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16
FLUSH_BYTES = 256 << 20  # larger than the H200's L2 (60 MB): each timed run starts cold
VERIFY_TOLERANCE = 2e-2  # bf16 operands land between 1e-3 and 1e-2 against a float32 reference
REFERENCE_BUDGET = 1 << 30  # bytes of working set per reference chunk


def sync(device="cuda") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_cached(device="cuda") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def ms_to_s(ms: float) -> float:
    return ms / 1e3


def under_tuning(text: str, fn: Callable) -> Callable:
    """fn run under astrai's kernel tuning `text` (plan.h), the previous tuning restored after:
    two forms of one op timed side by side in one process."""

    def call():
        previous = torch.ops.astr.kernel_tuning()
        torch.ops.astr.set_kernel_tuning(text)
        try:
            return fn()
        finally:
            torch.ops.astr.set_kernel_tuning(previous)

    return call


# --------------------------------------------------------------------------------------------
# Counting: bytes and FLOPs
# --------------------------------------------------------------------------------------------
def decode_bytes(
    batch: int,
    length: int,
    hq: int,
    hkv: int,
    head_dim: int,
    kv_element_bytes: int = 2,
    q_element_bytes: int = 2,
) -> int:
    """Fewest bytes a decode step moves: K and V of every live token read once, plus q read and
    the output written. The block table (4 bytes per page) is left out: under 0.1% of K+V at page
    size 1."""
    kv = 2 * batch * length * hkv * head_dim * kv_element_bytes
    q_and_out = 2 * batch * hq * head_dim * q_element_bytes
    return kv + q_and_out


def causal_prefill_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """A square causal prefill counted as 4 * B * H * S * S * D / 2: two matmuls of 2 FLOPs per
    multiply-add over half the S x S score matrix (the convention SDPA benchmarks use)."""
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
# Inputs: paged pools with realistic fragmentation
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
    batch: int,
    length: int,
    hq: int,
    hkv: int,
    head_dim: int,
    page_size: int = 16,
    device="cuda",
) -> tuple:
    """One decode step over `batch` sequences of `length` cached tokens (bf16, random, in a
    shuffled paged pool): q [B, Hq, D] and the keyword arguments of torch.ops.astr.attention."""
    q = torch.randn(batch, hq, head_dim, dtype=DTYPE, device=device)
    k = torch.randn(batch * length, hkv, head_dim, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    cache = build_paged_cache(k, v, [length] * batch, page_size)
    cache["query_start_loc"] = query_start_loc([1] * batch, device)
    return q, dict(cache, max_query_len=1, mode="decode")


def ragged_mix(
    seed: int, batch: int, prefix: Tuple[int, int], chunk: Tuple[int, int]
) -> Tuple[List[int], List[int]]:
    """Cached-prefix and new-chunk lengths of a chunked-prefill batch, each drawn uniformly from
    its inclusive range with a generator of its own (the mix depends on the seed alone)."""
    generator = torch.Generator().manual_seed(seed)
    prefix_lens = torch.randint(prefix[0], prefix[1] + 1, (batch,), generator=generator).tolist()
    chunk_lens = torch.randint(chunk[0], chunk[1] + 1, (batch,), generator=generator).tolist()
    return prefix_lens, chunk_lens


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def reference_attention(
    q: torch.Tensor,  # [B, Hq, Lq, D]
    k: torch.Tensor,  # [B, Hkv, Lk, D]
    v: torch.Tensor,  # [B, Hkv, Lk, D]
    is_causal: bool = False,
    attn_mask: Optional[torch.Tensor] = None,  # bool [Lq, Lk], True = attend
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [B, Hq, Lq, D] in dtype
    """Attention on inputs upcast to `dtype` (float32 for the benchmark's large shapes, float64
    where the reference must be exact), kv heads repeated for GQA, in chunks of batch and heads
    small enough that the Lq x Lk scores stay within REFERENCE_BUDGET. float32 runs on SDPA's
    efficient kernel where it takes the call; float64 only has the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, hq, lq, head_dim = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = hq // hkv
    element = torch.finfo(dtype).bits // 8
    per_head = element * (lq * lk + 2 * lk * head_dim + 2 * lq * head_dim)
    head_step = max(1, min(hq, REFERENCE_BUDGET // per_head))
    batch_step = max(1, REFERENCE_BUDGET // (per_head * hq)) if head_step == hq else 1
    out = torch.empty(batch, hq, lq, head_dim, dtype=dtype, device=q.device)
    backends = [SDPBackend.MATH]
    if dtype != torch.float64:
        backends.insert(0, SDPBackend.EFFICIENT_ATTENTION)
    for b0 in range(0, batch, batch_step):
        b1 = min(batch, b0 + batch_step)
        for h0 in range(0, hq, head_step):
            h1 = min(hq, h0 + head_step)
            kv_heads = torch.arange(h0, h1, device=q.device) // group
            qf = q[b0:b1, h0:h1].to(dtype)
            kf = k[b0:b1].index_select(1, kv_heads).to(dtype)
            vf = v[b0:b1].index_select(1, kv_heads).to(dtype)
            with sdpa_kernel(backends):
                out[b0:b1, h0:h1] = F.scaled_dot_product_attention(
                    qf, kf, vf, attn_mask=attn_mask, is_causal=is_causal
                )
    return out


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, out viewed in ref's shape and precision."""
    out = out.to(ref.dtype).reshape(ref.shape)
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
FLUSH_MODES = {
    # A read of a 256 MB buffer (a sum) leaves L2 cold and clean: every line the timed call
    # needs comes from memory, and no line of the flush is left to be written back.
    "read": "256 MB read between runs (L2 cold and clean, outside the events)",
    # A write of 256 MB (until 2026-12-02) leaves L2 full of dirty lines whose write-back then
    # runs inside the next timed call (results/decisions.md, "The benchmark's L2 flush").
    "write": "256 MB write between runs (L2 cold, full of dirty lines, outside the events)",
}


def summarize_times(times_ms: Sequence[float]) -> dict:
    """The statistics a row keeps of its timed runs: the median (the value of record), min,
    p10 and p90."""
    times = sorted(times_ms)
    return dict(
        ms=times[len(times) // 2],
        min_ms=times[0],
        p10_ms=times[len(times) // 10],
        p90_ms=times[(9 * len(times)) // 10],
        repeats=len(times),
    )


class Timer:
    """CUDA-event timing: warm-up, then `repeats` runs, each after a flush that evicts L2
    (FLUSH_MODES); the flush lies outside the events. Events are read after one final
    synchronize. On the CPU: the host clock, no flush."""

    def __init__(
        self,
        warmup: int,
        repeats: int,
        flush_mode: str = "read",
        device="cuda",
        flush_bytes: int = FLUSH_BYTES,
    ):
        if flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode: {flush_mode!r} is not one of {sorted(FLUSH_MODES)}")
        self.warmup, self.repeats = warmup, repeats
        self.flush_mode = flush_mode
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.flush = torch.empty(flush_bytes // 4 if self.on_gpu else 0, device=self.device)
        if flush_mode == "read" and self.on_gpu:
            self.flush.fill_(1.0)  # defined values to read

    def evict(self, i: int) -> None:
        if not self.on_gpu:
            return
        if self.flush_mode == "read":
            self.flush.sum()
        else:
            self.flush.fill_(float(i))

    def measure(self, fn: Callable, flush: bool = True, repeats: Optional[int] = None) -> dict:
        return self.measure_interleaved([fn], flush, repeats)[0]

    def measure_interleaved(
        self, fns: Sequence[Callable], flush: bool = True, repeats: Optional[int] = None
    ) -> List[dict]:
        """Times several callables in the same loop: run i times each of them once, each after
        its own flush, starting with callable i mod n, so that drift over the loop (clocks,
        temperature, other work on the device) falls on every callable alike. One callable is
        the plain case."""
        repeats = repeats or self.repeats
        for _ in range(self.warmup):
            for fn in fns:
                fn()
        sync(self.device)
        count = len(fns)
        samples: List[List[float]] = [[] for _ in fns]
        order = [[(i + j) % count for j in range(count)] for i in range(repeats)]
        if self.on_gpu:
            events = [
                [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in fns
                ]
                for _ in range(repeats)
            ]
            for i in range(repeats):
                for j in order[i]:
                    if flush:
                        self.evict(i * count + j)
                    start, end = events[i][j]
                    start.record()
                    fns[j]()
                    end.record()
            torch.cuda.synchronize()
            for i in range(repeats):
                for j in range(count):
                    start, end = events[i][j]
                    samples[j].append(start.elapsed_time(end))
        else:
            for i in range(repeats):
                for j in order[i]:
                    start = time.perf_counter()
                    fns[j]()
                    samples[j].append((time.perf_counter() - start) * 1e3)
        return [summarize_times(s) for s in samples]


def timing_parser(description: str, repeats: int = 30, warmup: int = 5) -> argparse.ArgumentParser:
    """A benchmark's command line with the options every timed table takes (--out, the results
    folder; --repeats; --warmup), for the benchmark to add its own to."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=warmup)
    return parser


def copy_rate(timer: Timer, nbytes: int = 4 << 30) -> Tuple[int, float]:
    """A device-to-device copy of `nbytes` (bf16): returns the bytes read + written and the
    median ms of 20 runs (no flush: the copy itself streams far more than L2 holds)."""
    src = torch.empty(nbytes // 2, dtype=DTYPE, device=timer.device).normal_()
    dst = torch.empty_like(src)
    timing = timer.measure(lambda: dst.copy_(src), flush=False, repeats=20)
    return 2 * src.numel() * src.element_size(), timing["ms"]


def copy_tbps(timer: Timer) -> float:
    """The device's copy rate in TB/s (copy_rate's bytes over its time): a memory-bound
    kernel's ceiling."""
    copy_bytes, copy_ms = copy_rate(timer)
    return copy_bytes / copy_ms / 1e9


def matmul_rate(timer: Timer, n: int = 8192) -> Tuple[int, float]:
    """A bf16 n x n x n matmul: returns n and the median ms of 20 runs."""
    a = torch.randn(n, n, dtype=DTYPE, device=timer.device)
    b = torch.randn(n, n, dtype=DTYPE, device=timer.device)
    return n, timer.measure(lambda: a @ b, flush=False, repeats=20)["ms"]


def measure_ceilings(timer: Timer, copy_bytes: int = 4 << 30, matmul_n: int = 8192) -> dict:
    """The two ceilings every rate is read against, measured in the same process: a
    device-to-device copy (bytes read + written) and a bf16 matmul."""
    nbytes, copy_ms = copy_rate(timer, copy_bytes)
    free_cached(timer.device)
    n, matmul_ms = matmul_rate(timer, matmul_n)
    free_cached(timer.device)
    return dict(
        copy_TBps=nbytes / ms_to_s(copy_ms) / 1e12,
        copy_bytes=nbytes,
        copy_ms=copy_ms,
        matmul_TFLOPs=2 * n**3 / ms_to_s(matmul_ms) / 1e12,
        matmul_ms=matmul_ms,
        matmul_shape=[n, n, n],
    )


def median_round(samples_ms: Sequence[float], nbytes: int) -> Tuple[float, float]:
    """The A/B probes' reading of one variant's per-round times: the upper median (ms) and the
    effective TB/s that `nbytes` moved in it."""
    median = sorted(samples_ms)[len(samples_ms) // 2]
    return median, nbytes / ms_to_s(median) / 1e12


# --------------------------------------------------------------------------------------------
# Running peers
# --------------------------------------------------------------------------------------------
def short_error(error: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
    reasons = [" ".join(str(w.message).split())[:200] for w in caught]
    if reasons:
        text += " | warnings: " + " ; ".join(dict.fromkeys(reasons))[:400]
    return text


class Runner:
    """Checks each peer's first output against the reference, times the ones that pass, keeps
    the rows, and survives peers that raise: a peer that cannot run a shape ends as an error
    string in its row and the run goes on."""

    def __init__(self, timer: Timer, ceilings: dict):
        self.timer, self.ceilings = timer, ceilings
        self.device = timer.device
        self.broken = ""  # set when a CUDA error poisons the context: later peers are skipped

    def prepare(
        self,
        row: dict,
        make_fn: Callable[[], Callable],
        check: Callable,
        ref: torch.Tensor,
        tolerance: float = VERIFY_TOLERANCE,
    ) -> Optional[Callable]:
        """Builds the timed callable (make_fn()), runs it once and records its rel L2 against
        ref (check(output) views the output like ref). Returns the callable, or None with
        row["error"] set."""
        if self.broken:
            row["error"] = "skipped: " + self.broken
            return None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn = make_fn()
                out = fn()
                sync(self.device)
                error = rel_l2(check(out), ref)
                row["rel_l2"] = error if math.isfinite(error) else str(error)
                row["verified"] = bool(math.isfinite(error) and error < tolerance)
                del out
            except Exception as exc:  # a peer that cannot run this shape: record, go on
                row["error"] = short_error(exc, caught)
                self.check_context(row)
                return None
        if caught:
            row["warnings"] = list(
                dict.fromkeys(" ".join(str(w.message).split())[:200] for w in caught)
            )
        return fn

    def time_together(self, rows: Sequence[dict], fns: Sequence[Callable]) -> None:
        """Times prepared callables interleaved (Timer.measure_interleaved); each row gets its
        callable's statistics, or the error that stopped the timing."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                timings = self.timer.measure_interleaved(fns)
            except Exception as exc:
                for row in rows:
                    row["error"] = short_error(exc)
                self.check_context(rows[0])
                return
        for row, timing in zip(rows, timings):
            row.update(timing)

    def run(
        self,
        row: dict,
        make_fn: Callable[[], Callable],
        check: Callable,
        ref: torch.Tensor,
        tolerance: float = VERIFY_TOLERANCE,
    ) -> dict:
        """One peer on one shape: prepare, then time."""
        fn = self.prepare(row, make_fn, check, ref, tolerance)
        if fn is not None:
            self.time_together([row], [fn])
        return row

    def check_context(self, row: dict) -> None:
        try:
            sync(self.device)
        except Exception as exc:
            self.broken = f"CUDA context broken by {row['peer']} ({short_error(exc)[:120]})"
        free_cached(self.device)


# --------------------------------------------------------------------------------------------
# Records: what a small benchmark writes (bench_attention.py has report.py)
# --------------------------------------------------------------------------------------------
def run_environment(repeats: int, **extra) -> dict:
    """The run a record describes: the command, GPU, torch and CUDA versions, date, repeats."""
    return dict(
        command="python3 " + " ".join(sys.argv),
        gpu=torch.cuda.get_device_properties(0).name,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        date=datetime.date.today().isoformat(),
        repeats=repeats,
        **extra,
    )


def write_record(out_dir: str, prefix: str, env: dict, data: dict, lines: List[str]) -> str:
    """<prefix>_<gpu>_<date>.json (env and data) and .md (lines) under out_dir; returns the
    stem's path."""
    stem = os.path.join(out_dir, f"{prefix}_{env['gpu'].replace(' ', '-')}_{env['date']}")
    os.makedirs(out_dir, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(dict(env=env, **data), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return stem
