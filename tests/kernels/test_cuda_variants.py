"""GPU tests of the cuda backend's attention variants (sliding window, logit softcap, sink logits,
the log-sum-exp output) in every decode form and both prefill kernels, against the float64
reference (tests/reference.py) written from the definitions (kernels/paged_attention/params.h):

    s = scale * q.k, then c * tanh(s / c) with a softcap c; a query at position p sees keys
    max(0, p - W) .. p with window_left W; softmax over the visible keys plus one sink logit per
    q head (no value); lse = log of that softmax's denominator.

Pools hold NaN in every slot no sequence owns (tests/kernels/test_cuda_kernels.py's PagedBatch),
and outputs are poisoned before each run.
"""

import math

import pytest
import torch

from tests.kernels.conftest import batch_cuda_op, captured_graph, cuda_op
from tests.kernels.test_cuda_kernels import (
    HEAD_DIMS,
    MERGE_TUNING,
    TOLERANCE,
    UNEQUAL_HEAD_DIMS,
    PagedBatch,
    needs_persistent_block,
    poison_next_allocation,
    reference,
    splits_tuning,
)

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda


def variant_reference(batch, q, scale, window_left=-1, softcap=None, sinks=None, attn_mask=None):
    """(out, lse) of the float64 reference (tests/reference.py), causal."""
    return reference(
        batch,
        q,
        True,
        scale,
        attn_mask,
        window_left=window_left,
        softcap=softcap,
        sinks=sinks,
        return_lse=True,
    )


def run(
    batch,
    q,
    decode,
    scale,
    window_left=-1,
    softcap=None,
    sinks=None,
    attn_mask=None,
    return_lse=True,
    k_scale=None,
    v_scale=None,
):
    """The cuda op over the batch's pools (an FP8 batch passes its scales), output poisoned."""
    poison_next_allocation((*q.shape[:-1], batch.v_cache.shape[-1]), q.dtype)
    return batch_cuda_op(
        batch,
        q,
        1 if decode else max(batch.q_lens_list),
        decode,
        attn_mask,
        True,
        scale,
        window_left,
        softcap or 0.0,
        sinks,
        return_lse,
        k_scale,
        v_scale,
    )


def assert_variant_close(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any(), "output has NaN (unwritten element or read of a NaN slot)"
    err = (out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)
    assert err < TOLERANCE[dtype], f"relative L2 error of out {err:.3e}"
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf where the reference is not"
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0
    assert lse_err < 2e-2, f"lse abs error {lse_err:.3e}"


# (window_left, softcap, sinks?): each variant alone, and together.
VARIANTS = {
    "window": (700, None, False),
    "window0": (0, None, False),
    "softcap": (-1, 2.0, False),
    "sinks": (-1, None, True),
    "lse": (-1, None, False),
    "all": (300, 5.0, True),
}


def make_sinks(hq, g):
    return (torch.randn(hq, generator=g, device="cuda") * 3).float()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "splits,merge",
    [
        (None, "auto"),
        (1, "auto"),
        (1, "eight"),
        (1, "persistent"),
        (2, "pairs"),
        (2, "cluster"),
        (2, "kernel"),
        (5, "auto"),
    ],
)
@pytest.mark.parametrize("head_dim", [h for h in HEAD_DIMS if h in (64, 96, 128)])
def test_decode_variants_match_reference(variant, splits, merge, head_dim, tuning):
    """Every decode form (forced; a form that cannot run here falls back to the plan's choice),
    each variant and all together; lengths 1 to 3000, one sequence shorter than its window."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    window_left, softcap, with_sinks = VARIANTS[variant]
    g = torch.Generator(device="cuda").manual_seed(700 + head_dim + (splits or 0))
    lens = [1, 129, 650, 3000, 1999]
    batch = PagedBatch(lens, [1] * len(lens), 8, 2, head_dim, 16, torch.bfloat16, generator=g)
    sinks = make_sinks(8, g) if with_sinks else None
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = run(batch, batch.q, True, scale, window_left, softcap, sinks)
    ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left, softcap, sinks)
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_variants_match_reference(variant, head_dim, dtype, prefill_kernel):
    """A ragged batch with cached prefixes (and a fresh prompt), page 16, GQA 4."""
    window_left, softcap, with_sinks = VARIANTS[variant]
    g = torch.Generator(device="cuda").manual_seed(900 + head_dim)
    q_lens = [300, 1, 130, 77]
    lens = [1300, 500, 130, 2077]
    batch = PagedBatch(lens, q_lens, 8, 2, head_dim, 16, dtype, generator=g)
    sinks = make_sinks(8, g) if with_sinks else None
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = run(batch, batch.q, False, scale, window_left, softcap, sinks)
    ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left, softcap, sinks)
    assert_variant_close(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("softcap", [2.0, 50.0, 55.0, 56.0, 200.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("head_dim", [h for h in HEAD_DIMS if h in (64, 128)])
def test_softcap_matches_reference_with_and_without_a_fixed_max(softcap, dtype, decode, head_dim):
    """A prefill with a softcap up to 55.4 and bf16 runs the softmax with its max fixed at 0
    (variant.cuh); a decode, a larger softcap or fp16 keep the running max. Both give the
    reference's answer on wide scores (q times 8 or more: scores of +-40 and more, weights from
    2^-80 to 2^80 with the fixed max), with a window that masks keys, and the lse."""
    g = torch.Generator(device="cuda").manual_seed(1100 + head_dim + int(softcap))
    lens, q_lens = ([40, 700, 2100], [1, 1, 1]) if decode else ([300, 900, 2100], [300, 64, 129])
    batch = PagedBatch(lens, q_lens, 8, 2, head_dim, 16, dtype, generator=g)
    q = (batch.q.float() * max(8.0, softcap / 4)).to(dtype)  # scores reach the cap
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = run(batch, q, decode, scale, 500, softcap)
    ref_out, ref_lse = variant_reference(batch, q, scale, 500, softcap)
    assert_variant_close(out, lse, ref_out, ref_lse, dtype)
    # Control: the same call without the softcap is far from the softcapped reference.
    plain, _ = run(batch, q, decode, scale, 500, None)
    assert (plain.double() - ref_out).abs().max().item() > 0.1


def test_prefill_variants_with_a_mask_and_a_row_that_sees_nothing(prefill_kernel):
    """A user mask with the window and sinks: a row that sees no key gives out 0 and lse = its
    sink; without sinks, lse -inf."""
    g = torch.Generator(device="cuda").manual_seed(5)
    batch = PagedBatch([300, 130], [50, 130], 8, 2, 128, 16, torch.bfloat16, generator=g)
    mask = torch.rand(batch.num_tokens, 250, generator=g, device="cuda") > 0.5
    mask[3] = False
    scale = 1.0 / math.sqrt(128)
    sinks = make_sinks(8, g)
    for s in (None, sinks):
        out, lse = run(batch, batch.q, False, scale, 100, None, s, attn_mask=mask)
        ref_out, ref_lse = variant_reference(batch, batch.q, scale, 100, None, s, mask)
        assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)
        assert (out[3] == 0).all()
        expected = s if s is not None else torch.full_like(lse[3], float("-inf"))
        assert torch.allclose(lse[3], expected), lse[3]


@pytest.mark.parametrize(
    "splits,merge", [(None, "auto"), (1, "eight"), (1, "persistent"), (2, "pairs"), (7, "auto")]
)
def test_decode_never_reads_tiles_wholly_outside_the_window(splits, merge, tuning):
    """NaN in slots the sequence owns but that lie two tiles or more before its window: the
    output stays finite, so those tiles were never read (cost follows the window)."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(61)
    lens = [6000, 5000, 4100]
    window_left = 1000
    batch = PagedBatch(lens, [1] * 3, 32, 8, 128, 16, torch.bfloat16, generator=g)
    for b, n in enumerate(lens):
        hidden = torch.arange(0, n - 1 - window_left - 2 * 128, device="cuda")
        pages = batch.block_table[b, hidden // 16].long()
        batch.k_cache[pages, hidden % 16] = float("nan")
        batch.v_cache[pages, hidden % 16] = float("nan")
    scale = 1.0 / math.sqrt(128)
    out, lse = run(batch, batch.q, True, scale, window_left)
    ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left)
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)


def test_prefill_never_reads_tiles_wholly_outside_the_window(prefill_kernel):
    g = torch.Generator(device="cuda").manual_seed(67)
    batch = PagedBatch([5000], [600], 8, 2, 128, 16, torch.bfloat16, generator=g)
    window_left = 500
    # The first query sits at 4400 and sees 3900..4400: slots below 3900 - 256 are never read.
    hidden = torch.arange(0, 3900 - 256, device="cuda")
    pages = batch.block_table[0, hidden // 16].long()
    batch.k_cache[pages, hidden % 16] = float("nan")
    batch.v_cache[pages, hidden % 16] = float("nan")
    scale = 1.0 / math.sqrt(128)
    out, lse = run(batch, batch.q, False, scale, window_left)
    ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left)
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize(
    "splits,merge", [(None, "auto"), (1, "persistent"), (2, "pairs"), (2, "kernel")]
)
def test_decode_variants_under_cuda_graph_replay_with_growing_lengths(splits, merge, tuning):
    """One captured decode step with a window, a softcap, sinks and the lse, replayed as the
    sequences grow past the window."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(23)
    hq, hkv, d = 32, 8, 128
    batch = PagedBatch([4096] * 4, [1] * 4, hq, hkv, d, 16, torch.bfloat16, generator=g)
    batch.k_cache.copy_(torch.randn(batch.k_cache.shape, generator=g, device="cuda"))
    batch.v_cache.copy_(torch.randn(batch.v_cache.shape, generator=g, device="cuda"))
    static_lens = torch.tensor([3, 1, 17, 100], dtype=torch.int32, device="cuda")
    static_q = batch.q.clone()
    sinks = make_sinks(hq, g)
    scale, window_left, softcap = 1.0 / math.sqrt(d), 511, 20.0
    args = (
        static_q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        static_lens,
        batch.query_start_loc,
        1,
        True,
        None,
        True,
        scale,
        window_left,
        softcap,
        sinks,
        True,
    )
    graph, (static_out, static_lse) = captured_graph(lambda: cuda_op(*args))
    for lens in ([3, 1, 17, 100], [64, 600, 700, 1000], [2048, 129, 4000, 4096]):
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(torch.randn(static_q.shape, generator=g, device="cuda"))
        static_out.fill_(float("nan"))
        static_lse.fill_(float("nan"))
        graph.replay()
        batch.seq_lens_list = lens
        ref_out, ref_lse = variant_reference(batch, static_q, scale, window_left, softcap, sinks)
        assert_variant_close(static_out, static_lse, ref_out, ref_lse, torch.bfloat16)


@needs_persistent_block
def test_persistent_decode_windows_items_of_every_length(tuning):
    """The persistent decode's items start at their window's first tile: 61 ragged sequences on 5
    blocks, windows narrower and wider than the sequences."""
    tuning("decode_form=persistent,persistent_blocks=5")
    g = torch.Generator(device="cuda").manual_seed(71)
    lens = torch.randint(1, 6000, (61,), generator=g, device="cuda").tolist()
    lens[10:16] = [1, 2, 128, 129, 257, 1000]
    batch = PagedBatch(lens, [1] * 61, 16, 4, 128, 16, torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(128)
    for window_left in (0, 127, 900, 10000):
        out, lse = run(batch, batch.q, True, scale, window_left)
        ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left)
        assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)


# Gemma 4's global layers (512: two blocks per row, each a chunk of 256 output columns) and
# DeepSeek's MHA form (q/k 192, v 128), where the library has them.
NEW_HEAD_DIMS = [d for d in [(512, 512), *UNEQUAL_HEAD_DIMS] if d[0] in HEAD_DIMS or d[0] != d[1]]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "splits,merge", [(None, "auto"), (1, "auto"), (2, "cluster"), (2, "kernel"), (5, "auto")]
)
@pytest.mark.parametrize("head_dims", NEW_HEAD_DIMS)
def test_decode_variants_of_the_new_head_dims_match_reference(
    variant, splits, merge, head_dims, tuning
):
    """Each variant and all together in every decode form that runs these head dims."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    d, dv = head_dims
    window_left, softcap, with_sinks = VARIANTS[variant]
    g = torch.Generator(device="cuda").manual_seed(710 + d + dv + (splits or 0))
    lens = [1, 129, 650, 3000, 1999]
    batch = PagedBatch(
        lens, [1] * len(lens), 8, 2, d, 16, torch.bfloat16, generator=g, head_dim_v=dv
    )
    sinks = make_sinks(8, g) if with_sinks else None
    scale = 1.0 / math.sqrt(d)
    out, lse = run(batch, batch.q, True, scale, window_left, softcap, sinks)
    ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left, softcap, sinks)
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dims", UNEQUAL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_variants_of_unequal_head_dims_match_reference(variant, head_dims, dtype):
    """The prefill over q/k and v head dims of their own (D = 512: the HEAD_DIMS test above)."""
    d, dv = head_dims
    window_left, softcap, with_sinks = VARIANTS[variant]
    g = torch.Generator(device="cuda").manual_seed(910 + d + dv)
    q_lens = [300, 1, 130, 77]
    lens = [1300, 500, 130, 2077]
    batch = PagedBatch(lens, q_lens, 8, 2, d, 16, dtype, generator=g, head_dim_v=dv)
    sinks = make_sinks(8, g) if with_sinks else None
    scale = 1.0 / math.sqrt(d)
    out, lse = run(batch, batch.q, False, scale, window_left, softcap, sinks)
    ref_out, ref_lse = variant_reference(batch, batch.q, scale, window_left, softcap, sinks)
    assert_variant_close(out, lse, ref_out, ref_lse, dtype)
