"""Batch-invariant mode on the CPU (torch_native): a sequence's output rows and lse of a paged call
are the same bits whatever the batch around it (the other sequences, its position, the batch size,
the block table's width), for decode, verify (a tree of drafts) and prefill, in bf16, fp16,
float32 and over an FP8 cache, with random variants. Checked as a property (hypothesis): random
sequences computed alone and in random batches of 1 to 16 at random positions, compared bitwise.

The control: in the default mode the same comparison finds differing bits (torch_native's SDPA
and matmuls block by the whole batch's sizes), so the property can fail. The switch itself:
astrai.set_batch_invariant, torch.ops.astr.set_batch_invariant, ASTR_BATCH_INVARIANT at load.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import astrai
import astrai.extension as ae
from tests.reference import (
    assert_close_to_reference,
    pack_tree_masks,
    paged_reference,
    quantize,
    random_tree_parents,
    tree_of_drafts,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROPERTY = settings(max_examples=30, deadline=None, derandomize=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def batch_invariant(enabled: bool):
    before = astrai.batch_invariant()
    astrai.set_batch_invariant(enabled)
    try:
        yield
    finally:
        astrai.set_batch_invariant(before)


@dataclass
class Sequence:
    """One sequence of a call: its tokens' k/v (cached and new, float32 values), its new tokens'
    q, and for a verify the tree of its drafts."""

    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor
    q: torch.Tensor  # [n, Hq, D]
    tree: Optional[torch.Tensor]  # [n, n] bool

    @property
    def length(self):
        return self.k.shape[0]

    @property
    def new(self):
        return self.q.shape[0]


@dataclass
class Shape:
    kind: str  # "decode", "verify", "prefill"
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype  # q's (and a 16-bit cache's)
    cache_dtype: Optional[torch.dtype]  # an FP8 cache
    variants: dict


def make_sequence(shape: Shape, prefix: int, new: int, g) -> Sequence:
    length = prefix + new
    k = torch.randn(length, shape.kv_heads, shape.head_dim, generator=g)
    v = torch.randn(length, shape.kv_heads, shape.head_dim, generator=g)
    q = torch.randn(new, shape.q_heads, shape.head_dim, generator=g)
    tree = tree_of_drafts(random_tree_parents(new, g)) if shape.kind == "verify" else None
    return Sequence(k, v, q, tree)


def run_call(
    shape: Shape, sequences, extra_width: int, g, scales, device="cpu", backend="torch_native"
):
    """The op over `sequences` in order, on shuffled pages of a pool padded with random values and
    a block table padded with random page ids (built on the CPU, run on `device` by `backend`);
    -> (out, lse, the rows of each sequence, the variant arguments, the pools and metadata)."""
    page = shape.page_size
    pages = [max(1, math.ceil(s.length / page)) for s in sequences]
    num_pages = sum(pages) + 2
    width = max(pages) + extra_width
    pool_shape = (num_pages, page, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(pool_shape, generator=g)
    v_cache = torch.randn(pool_shape, generator=g)
    table = torch.randint(0, num_pages, (len(sequences), width), generator=g, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=g)
    start = 0
    for b, (s, n) in enumerate(zip(sequences, pages)):
        ids = order[start : start + n]
        start += n
        table[b, :n] = ids.int()
        positions = torch.arange(s.length)
        k_cache[ids[positions // page], positions % page] = s.k
        v_cache[ids[positions // page], positions % page] = s.v
    args = {}
    if shape.cache_dtype is not None:
        k_scale, v_scale = scales
        k_cache = quantize(k_cache, k_scale, shape.cache_dtype)
        v_cache = quantize(v_cache, v_scale, shape.cache_dtype)
        args.update(k_scale=k_scale, v_scale=v_scale)
    else:
        k_cache, v_cache = k_cache.to(shape.dtype), v_cache.to(shape.dtype)
    rows, first = [], 0
    for s in sequences:
        rows.append(slice(first, first + s.new))
        first += s.new
    starts = torch.tensor([0] + [r.stop for r in rows], dtype=torch.int32)
    max_query_len = max(s.new for s in sequences)
    if shape.kind == "verify":
        args["tree_mask"] = pack_tree_masks([s.tree for s in sequences], max_query_len)
    args.update(shape.variants)
    args = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in args.items()
    }
    k_cache, v_cache, table, starts = (t.to(device) for t in (k_cache, v_cache, table, starts))
    out, lse = torch.ops.astr.attention(
        torch.cat([s.q for s in sequences]).to(shape.dtype).to(device),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table,
        seq_lens=torch.tensor([s.length for s in sequences], dtype=torch.int32, device=device),
        query_start_loc=None if shape.kind == "decode" else starts,
        max_query_len=1 if shape.kind == "decode" else max_query_len,
        mode="decode" if shape.kind == "decode" else "prefill",
        is_causal=True,
        backend=backend,
        return_lse=True,
        **args,
    )
    return out, lse, rows, args, (k_cache, v_cache, table, starts)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@st.composite
def shapes(draw, kinds=("decode", "verify", "prefill"), head_dims=(8, 16, 64), dtypes=None):
    """A call's shape: kind, heads (GQA 2), head dim, page size, dtype (q bf16 over a quarter of
    FP8 caches; dtypes: the 16-bit q's choices), random variants."""
    dtypes = dtypes or (torch.bfloat16, torch.float16, torch.float32)
    kind = draw(st.sampled_from(kinds))
    kv_heads = draw(st.integers(1, 2))
    fp8 = draw(st.booleans()) and draw(st.booleans())  # a quarter of the calls
    variants = {}
    if draw(st.booleans()):
        variants["window_left"] = draw(st.integers(0, 200))
    if draw(st.booleans()):
        variants["softcap"] = draw(st.sampled_from([2.0, 30.0]))
    if draw(st.booleans()):
        variants["sinks"] = torch.tensor(
            draw(st.lists(st.floats(-3, 3), min_size=kv_heads * 2, max_size=kv_heads * 2)),
            dtype=torch.float32,
        )
    return Shape(
        kind=kind,
        q_heads=kv_heads * 2,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from(head_dims)),
        page_size=draw(st.sampled_from([1, 4, 16, 256])),
        dtype=torch.bfloat16 if fp8 else draw(st.sampled_from(dtypes)),
        cache_dtype=torch.float8_e4m3fn if fp8 else None,
        variants=variants,
    )


def new_tokens(draw, kind):
    return {"decode": 1, "verify": draw(st.integers(2, 16)), "prefill": draw(st.integers(1, 40))}[
        kind
    ]


@st.composite
def alone_and_batched(draw, max_batch=16, max_prefix=400, **shape_choices):
    """A shape, a seed, the target's prefix and new tokens, and a batch around it: its size,
    the target's place, each other sequence's prefix and new tokens, and both tables' padding."""
    shape = draw(shapes(**shape_choices))
    prefixes = st.one_of(st.integers(0, 64), st.integers(0, max_prefix))
    target = (draw(prefixes), new_tokens(draw, shape.kind))
    batch = draw(st.integers(1, max_batch))
    others = [(draw(prefixes), new_tokens(draw, shape.kind)) for _ in range(batch - 1)]
    place = draw(st.integers(0, batch - 1))
    paddings = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    return shape, draw(st.integers(0, 2**31)), target, others, place, paddings


def compare_alone_and_batched(example, device="cpu", backend="torch_native"):
    """(same out bits, same lse bits) of the target computed alone and in its batch; also checks
    the batched result against the float64 reference."""
    shape, seed, target, others, place, (pad_alone, pad_batch) = example
    g = torch.Generator().manual_seed(seed)
    scales = ((torch.rand(shape.kv_heads, generator=g) + 0.5) / 50,) * 2
    mine = make_sequence(shape, *target, g)
    batch = [make_sequence(shape, prefix, new, g) for prefix, new in others]
    batch.insert(place, mine)
    out_a, lse_a, rows_a, _, _ = run_call(shape, [mine], pad_alone, g, scales, device, backend)
    out_b, lse_b, rows_b, args, (k_cache, v_cache, table, starts) = run_call(
        shape, batch, pad_batch, g, scales, device, backend
    )
    ref = paged_reference(
        torch.cat([s.q for s in batch]).to(shape.dtype).to(device),
        k_cache,
        v_cache,
        table,
        [s.length for s in batch],
        None if shape.kind == "decode" else starts,
        is_causal=True,
        k_scale=args.get("k_scale"),
        v_scale=args.get("v_scale"),
        tree_mask=args.get("tree_mask"),
        **shape.variants,
    )
    assert_close_to_reference(out_b, ref, torch.bfloat16 if shape.dtype != torch.float32 else None)
    return (
        same_bits(out_a[rows_a[0]], out_b[rows_b[place]]),
        same_bits(lse_a[rows_a[0]], lse_b[rows_b[place]]),
    )


@PROPERTY
@given(alone_and_batched())
def test_a_sequences_rows_are_the_same_bits_alone_and_in_any_batch(example):
    with batch_invariant(True):
        same_out, same_lse = compare_alone_and_batched(example)
    assert same_out, "out differs between the sequence alone and in its batch"
    assert same_lse, "lse differs between the sequence alone and in its batch"


def test_control_the_default_mode_is_not_batch_invariant_here():
    """Without the mode the same comparison finds differing bits on this CPU: the property above
    can fail."""
    differing = 0
    for seed in range(12):
        for kind in ("decode", "verify", "prefill"):
            shape = Shape(kind, 8, 2, 64, 16, torch.float32, None, {"softcap": 30.0})
            target = (57 + seed, {"decode": 1, "verify": 6, "prefill": 9}[kind])
            others = [(300, {"decode": 1, "verify": 16, "prefill": 40}[kind])] * 3
            example = (shape, seed, target, others, seed % 4, (0, 2))
            with batch_invariant(False):
                same_out, _ = compare_alone_and_batched(example)
            differing += not same_out
    assert differing > 0


def test_the_switch_is_the_ops_and_the_api_reads_it():
    assert astrai.batch_invariant() is False
    with batch_invariant(True):
        assert torch.ops.astr.batch_invariant() is True
        assert ae.batch_invariant() is True
    assert torch.ops.astr.batch_invariant() is False
    with pytest.raises(TypeError, match="enabled: expected True or False"):
        astrai.set_batch_invariant(1)
    assert astrai.batch_invariant() is False


def switch_at_load(value: str):
    env = dict(os.environ, ASTR_BATCH_INVARIANT=value, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-c", "import astrai; print(astrai.batch_invariant())"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_the_environment_variable_is_read_at_load_as_a_switch():
    assert switch_at_load("On").stdout.strip() == "True"
    assert switch_at_load("no").stdout.strip() == "False"
    bad = switch_at_load("maybe")
    assert bad.returncode != 0
    assert "ASTR_BATCH_INVARIANT: expected 1, true, yes or on" in bad.stderr
    assert "got 'maybe'" in bad.stderr


def test_compiled_calls_recompile_when_the_mode_changes():
    """The torch_native backend is decomposed when a graph is traced: a graph traced in one mode
    must not run in the other (the Python API reads the switch where dynamo guards on it). One
    frame (fullgraph): a guard that fails recompiles it, which calls the backend again."""
    torch._dynamo.reset()  # earlier compiles in this process may have used up the recompile limit
    traced = []

    def counting_backend(graph, inputs):
        traced.append(graph)
        return graph.forward

    cache = ae.PagedKVCache(1, 16, 4, 2, 8, dtype=torch.float32)
    cache.begin_step([0, 1], [3, 5])

    @torch.compile(backend=counting_backend, fullgraph=True)
    def step(q):
        return ae.attention(
            q, None, None, kv_cache=cache, fwd="prefill", is_causal=True, backend="torch_native"
        )

    q = torch.randn(1, 8, 4, 8)
    step(q)
    step(q)  # (the first call made the backend's singleton, which the first graph guarded on)
    compiled = len(traced)
    step(q)
    assert len(traced) == compiled  # no recompile in the same mode
    with batch_invariant(True):
        step(q)
        assert len(traced) == compiled + 1
    step(q)
    assert len(traced) == compiled + 1  # the default mode's graph again
