"""Latent attention (``astr::mla_attention``) on the CPU (torch_native, the float reference)
against the float64 reference written from the definition (tests/mla_reference.py), on fresh
random latents in shuffled pages whose unowned slots are NaN (tests/mla_batch.py):

- decode and prefill, ragged batches with cached prefixes, page sizes 1/16/64/256, H = 16, 32,
  64 and 128, s_q = 1 and 2 (multi-token prediction), bf16, fp16 and float32;
- the log-sum-exp, non-causal calls, a decode padding slot;
- an FP8 (e4m3) latent with its float32 scale, with a control that a backend ignoring the scale
  would pass;
- gradients in the queries (the composite is differentiable).
"""

from __future__ import annotations

import math

import pytest
import torch

from astrai import mla_attention
from tests.mla_batch import LatentBatch
from tests.mla_reference import mla_reference

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}

# Lengths spanning several pages at every page size, with cached prefixes of every kind: a fresh
# sequence, one mid-page, one ending on a page boundary.
SEQ_LENS = (300, 37, 256, 5)


def check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "NaN or inf: an unowned (NaN) slot was read"
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)


def run(batch, **kwargs):
    return mla_attention(*batch.op_args(), backend="torch_native", **kwargs)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_decode_matches_the_reference(heads, page_size):
    batch = LatentBatch(
        SEQ_LENS,
        [1] * len(SEQ_LENS),
        heads=heads,
        page_size=page_size,
        dtype=torch.bfloat16,
        decode=True,
        seed=heads + page_size,
    )
    check(run(batch), batch.reference(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_ragged_prefill_with_cached_prefixes_matches_the_reference(page_size, dtype):
    # New tokens: a whole prompt (5 of 5), a chunk after a cached prefix, one token mid-page.
    q_lens = (40, 37, 1, 5)
    batch = LatentBatch(SEQ_LENS, q_lens, heads=16, page_size=page_size, dtype=dtype, seed=7)
    check(run(batch), batch.reference(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("s_q", [1, 2])
def test_speculative_tokens_per_sequence_match_the_reference(s_q, heads, dtype):
    """s_q new tokens per sequence (2: multi-token prediction), as a prefill call."""
    batch = LatentBatch(
        SEQ_LENS, [s_q] * len(SEQ_LENS), heads=heads, page_size=64, dtype=dtype, seed=s_q
    )
    check(run(batch), batch.reference(), dtype)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_lse_is_the_log_of_each_rows_denominator(decode):
    q_lens = [1] * len(SEQ_LENS) if decode else (3, 2, 1, 5)
    batch = LatentBatch(
        SEQ_LENS, q_lens, heads=16, page_size=16, dtype=torch.float32, decode=decode
    )
    out, lse = run(batch, return_lse=True)
    ref_out, ref_lse = batch.reference(return_lse=True)
    check(out, ref_out, torch.float32)
    assert lse.dtype == torch.float32 and lse.shape == (batch.num_tokens, 16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_the_op_returns_lse_through_its_overload():
    batch = LatentBatch((9, 4), (2, 1), heads=16, page_size=4, dtype=torch.float32)
    out, lse = torch.ops.astr.mla_attention(*batch.op_args(), return_lse=True)
    torch.testing.assert_close(out, torch.ops.astr.mla_attention(*batch.op_args()))
    assert lse.shape == (3, 16)


def test_non_causal_rows_see_their_whole_sequence():
    batch = LatentBatch((30, 12), (4, 3), heads=16, page_size=8, dtype=torch.float32)
    out = run(batch, is_causal=False)
    check(out, batch.reference(is_causal=False), torch.float32)
    # The control: causal rows see less, and differ.
    assert not torch.allclose(out.double(), batch.reference(is_causal=True), atol=1e-3)


def test_a_decode_padding_slot_gives_zeros_and_lse_minus_inf():
    batch = LatentBatch(
        (20, 0, 7), (1, 1, 1), heads=16, page_size=8, dtype=torch.float32, decode=True
    )
    out, lse = run(batch, return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all()
    check(out, batch.reference(), torch.float32)


def test_a_nan_query_row_gives_nan_out_and_nan_lse_not_an_empty_row():
    """A NaN score is no "saw nothing": out and lse are NaN (lse -inf would let a merge of
    partial attentions drop the row's NaN), and the other rows are untouched."""
    batch = LatentBatch((20, 9), (1, 1), heads=16, page_size=8, dtype=torch.float32, decode=True)
    batch.q_nope[1, 3, 7] = float("nan")
    out, lse = run(batch, return_lse=True)
    assert torch.isnan(out[1, 3]).all() and torch.isnan(lse[1, 3])
    others = torch.ones(2, 16, dtype=torch.bool)
    others[1, 3] = False
    assert torch.isfinite(out[others]).all() and torch.isfinite(lse[others]).all()


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp8_latent_is_read_with_its_scale(dtype, decode):
    q_lens = [1] * len(SEQ_LENS) if decode else (6, 2, 1, 5)
    batch = LatentBatch(
        SEQ_LENS, q_lens, heads=32, page_size=64, dtype=dtype, fp8=True, decode=decode
    )
    assert batch.ckv_cache.dtype == torch.float8_e4m3fn
    out = run(batch, ckv_scale=batch.ckv_scale)
    check(out, batch.reference(), dtype)
    # The control: what a backend that ignored the scale would return is far from it.
    ignored = batch.reference(ignore_scale=True)
    assert (out.double() - ignored).abs().max() > 10 * TOLERANCE[dtype] * ignored.abs().max()


def test_an_fp8_latent_without_its_scale_is_refused():
    batch = LatentBatch(
        (9,), (1,), heads=16, page_size=4, dtype=torch.bfloat16, fp8=True, decode=True
    )
    with pytest.raises(ValueError, match=r"ckv_scale: an FP8 latent cache .* needs its float32"):
        run(batch)


def test_float64_queries_match_the_reference_closely():
    batch = LatentBatch((33, 7), (5, 7), heads=16, page_size=16, dtype=torch.float64)
    out = run(batch)
    torch.testing.assert_close(out, batch.reference(), atol=1e-10, rtol=1e-10)


def test_gradients_flow_into_the_queries():
    """torch_native is a composite of differentiable ops: gradcheck in float64 on small dims
    (the reference backend takes any latent and rope dims)."""
    batch = LatentBatch(
        (7, 4), (3, 4), heads=2, page_size=2, dtype=torch.float64, latent_dim=6, rope_dim=2
    )
    q_nope = batch.q_nope.clone().requires_grad_()
    q_rope = batch.q_rope.clone().requires_grad_()
    args = list(batch.op_args())

    def attend(q_nope, q_rope):
        return mla_attention(q_nope, q_rope, *args[2:])

    assert torch.autograd.gradcheck(attend, (q_nope, q_rope))


def test_the_scale_multiplies_every_score():
    batch = LatentBatch((12,), (3,), heads=16, page_size=4, dtype=torch.float32)
    args = list(batch.op_args())
    args[-1] = 0.5
    out = mla_attention(*args)
    ref = mla_reference(
        batch.q_nope,
        batch.q_rope,
        batch.ckv_cache,
        batch.krope_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        scale=0.5,
    )
    check(out, ref, torch.float32)
    assert not torch.allclose(out.double(), batch.reference(), atol=1e-3)  # scale 1/sqrt(576)
    assert math.isclose(batch.scale, 576**-0.5)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_batch_invariant_mode_gives_a_sequence_the_same_bits_in_any_batch(decode):
    """set_batch_invariant(True): a sequence's rows are the same bits alone and beside longer
    sequences (a wider block table, more query rows padding it). torch_native's batched matmuls
    gave this already on the CPU where it was written; the test keeps the promise."""
    from astrai import batch_invariant, set_batch_invariant

    seq_lens = (37, 300, 9, 100, 700, 50)
    q_lens = (1,) * 6 if decode else (3, 40, 2, 17, 64, 1)
    batch = LatentBatch(
        seq_lens, q_lens, heads=16, page_size=16, dtype=torch.float32, decode=decode, seed=5
    )
    first = slice(0, q_lens[0])
    alone = LatentBatch((37,), q_lens[:1], heads=16, page_size=16, dtype=torch.float32)
    alone.decode = decode
    # The same sequence: its queries, and its pages of the big batch's pool.
    alone.q_nope, alone.q_rope = batch.q_nope[first], batch.q_rope[first]
    alone.ckv_cache, alone.krope_cache = batch.ckv_cache, batch.krope_cache
    alone.block_table = batch.block_table[:1, :3].contiguous()
    before = batch_invariant()
    set_batch_invariant(True)
    try:
        together = run(batch)[first]
        by_itself = run(alone)
    finally:
        set_batch_invariant(before)
    assert torch.equal(together, by_itself)
    check(by_itself, alone.reference(), torch.float32)
