"""GPU tests of batch-invariant mode on the cuda backend: a sequence's output rows and lse are the
same bits whatever the batch around it, for decode, verify (a tree of drafts) and prefill, in bf16,
fp16 and over an FP8 cache, eagerly and under CUDA-graph replay. Checked as a property
(hypothesis, tests/extension/test_batch_invariance.py's calls): random sequences computed alone
and in random batches of 1 to 128 at random positions, compared bitwise, each batch also against
the float64 reference.

The control: in the default mode a long sequence alone (33 splits on an H100) and in a batch of
64 (one split) gives other bits, so the property can fail.
"""

import math

import pytest
import torch

from tests.extension.test_batch_invariance import (
    Shape,
    alone_and_batched,
    batch_invariant,
    bits,
    compare_alone_and_batched,
    make_sequence,
    run_call,
    same_bits,
)
from tests.kernels.conftest import batch_cuda_op, captured_graph, cuda_op
from tests.kernels.test_cuda_kernels import HEAD_DIMS, PagedBatch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda

GPU_PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@GPU_PROPERTY
@given(
    alone_and_batched(
        max_batch=128, max_prefix=3000, head_dims=tuple(HEAD_DIMS), dtypes=KERNEL_DTYPES
    )
)
def test_a_sequences_rows_are_the_same_bits_alone_and_in_any_batch(example):
    with batch_invariant(True):
        same_out, same_lse = compare_alone_and_batched(example, "cuda", "cuda")
    assert same_out, "out differs between the sequence alone and in its batch"
    assert same_lse, "lse differs between the sequence alone and in its batch"


@settings(max_examples=15, deadline=None, derandomize=True)
@given(alone_and_batched(max_batch=32, max_prefix=2000, head_dims=(64, 128)))
def test_torch_native_on_the_gpu_is_batch_invariant_too(example):
    with batch_invariant(True):
        same_out, same_lse = compare_alone_and_batched(example, "cuda", "torch_native")
    assert same_out and same_lse


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
def test_control_the_default_mode_is_not_batch_invariant(kind):
    """A long sequence alone takes many splits (decode, verify) or a verify form where its batch
    takes the prefill kernel; in a batch of 64 the default plan picks another form."""
    differing = 0
    for seed in range(4):
        shape = Shape(kind, 32, 8, 128, 16, torch.bfloat16, None, {})
        new = {"decode": 1, "verify": 4, "prefill": 4}[kind]
        others = [(3000, {"decode": 1, "verify": 4, "prefill": 40}[kind])] * 63
        example = (shape, seed, (20000 + seed, new), others, seed * 7, (0, 0))
        with batch_invariant(False):
            same_out, _ = compare_alone_and_batched(example, "cuda", "cuda")
        differing += not same_out
    assert differing > 0


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["16bit", "e4m3"])
def test_cuda_graph_replays_give_the_eager_alone_bits_at_every_position(kind, fp8):
    """One captured step of 8 sequences (static q, tables and lengths), replayed with the target
    sequence at each position among fresh others: its rows are the bits of the eager call of the
    target alone."""
    g = torch.Generator().manual_seed(41)
    shape = Shape(kind, 32, 8, 128, 16, torch.bfloat16, fp8, {"window_left": 3000})
    new = {"decode": 1, "verify": 6, "prefill": 6}[kind]
    scales = ((torch.rand(8, generator=g) + 0.5) / 50,) * 2
    with batch_invariant(True):
        mine = make_sequence(shape, 4000, new, g)
        alone, alone_lse, _, _, _ = run_call(shape, [mine], 0, g, scales, "cuda", "cuda")
        batch = [make_sequence(shape, 5000, new, g) for _ in range(8)]
        out, lse, rows, args, (k_cache, v_cache, table, starts) = run_call(
            shape, batch, 0, g, scales, "cuda", "cuda"
        )
        static = dict(
            q=torch.cat([s.q for s in batch]).to(shape.dtype).cuda(),
            k_cache=k_cache,
            v_cache=v_cache,
            block_table=table,
            seq_lens=torch.tensor([s.length for s in batch], dtype=torch.int32, device="cuda"),
            query_start_loc=None if kind == "decode" else starts,
        )

        def step():
            return torch.ops.astr.attention(
                **static,
                max_query_len=1 if kind == "decode" else new,
                mode="decode" if kind == "decode" else "prefill",
                is_causal=True,
                backend="cuda",
                return_lse=True,
                **args,
            )

        graph, (static_out, static_lse) = captured_graph(step)
        for place in range(8):
            # The target's tokens over sequence `place`'s pages (each table row holds enough).
            page = shape.page_size
            positions = torch.arange(mine.length)
            ids = table[place, positions // page].long().cpu()
            pools = (k_cache, v_cache)
            for pool, values, scale in zip(pools, (mine.k, mine.v), scales):
                if fp8 is not None:
                    values = (values / scale.view(-1, 1)).clamp(-448, 448).to(fp8)
                pool[ids, positions % page] = values.to(pool.dtype).cuda()
            static["seq_lens"][place] = mine.length
            q = static["q"]
            q[rows[place]] = mine.q.to(shape.dtype).cuda()
            if "tree_mask" in args:
                args["tree_mask"][rows[place], : mine.new] = mine.tree.cuda()
            static_out.fill_(float("nan"))
            graph.replay()
            assert same_bits(static_out[rows[place]], alone), place
            assert torch.equal(bits(static_lse[rows[place]]), bits(alone_lse))
            # Restore the sequence it replaced, for the next place.
            other = batch[place]
            positions = torch.arange(other.length)
            ids = table[place, positions // page].long().cpu()
            for pool, values, scale in zip(pools, (other.k, other.v), scales):
                if fp8 is not None:
                    values = (values / scale.view(-1, 1)).clamp(-448, 448).to(fp8)
                pool[ids, positions % page] = values.to(pool.dtype).cuda()
            static["seq_lens"][place] = other.length
            q[rows[place]] = other.q.to(shape.dtype).cuda()
            if "tree_mask" in args:
                args["tree_mask"][rows[place], : other.new] = other.tree.cuda()


def test_a_decode_splits_into_fixed_tiles_whose_extra_splits_add_nothing():
    """Batch-invariant decode over a wide table: splits of 16 tiles; a short sequence's rows equal
    the bits it gets over its own narrow table, and the float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(3)
    wide = PagedBatch([50, 9000], [1, 1], 32, 8, 128, 16, torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(128)
    with batch_invariant(True):
        out_wide, _ = batch_cuda_op(
            wide,
            wide.q,
            1,
            True,
            None,
            True,
            scale,
        )
        narrow_table = wide.block_table[:1, :4].contiguous()
        out_narrow, _ = cuda_op(
            wide.q[:1],
            wide.k_cache,
            wide.v_cache,
            narrow_table,
            wide.seq_lens[:1],
            None,
            1,
            True,
            None,
            True,
            scale,
        )
    assert same_bits(out_wide[:1], out_narrow)
