"""GPU tests of sparse top-k attention on the cuda kernels (topk_attention_kernel.cuh), against the
float64 reference (tests/reference.py):

    row t (a query token of a decode or a ragged prefill) sees exactly the kv positions that
    topk_indices[t] lists (positions within its sequence, shared by all heads; -1 lists nothing,
    a position listed twice counts once) that its causal mask and window also allow; softcap,
    sinks, lse and an FP8 cache apply as usual.

Decode and ragged prefill, page sizes 1, 16 and 256, every head-dim row with top-k kernels
(DeepSeek's MHA form, q/k 192 with v 128, among them), window + softcap + sinks + lse (+ FP8)
together, the split counts of the plan and forced ones; rows with -1 entries, repeats
and entries the mask hides; each with a control that fails if the indices are ignored. Bad entries
poison only their own row (and checked mode names them); CUDA-graph replay with changing indices
and lengths; batch-invariant mode. Pools hold NaN in every slot no sequence owns, and outputs are
poisoned first (test_cuda_kernels.py): a read of an unlisted slot or an unwritten row shows up.
"""

import math

import pytest
import torch

from astrai.extension import ops
from tests.extension.test_batch_invariance import batch_invariant
from tests.kernels.conftest import batch_cuda_op, captured_graph, cuda_op
from tests.kernels.test_cuda_fp8 import Fp8Batch
from tests.kernels.test_cuda_kernels import (
    PagedBatch,
    output_shape,
    poison_next_allocation,
    reference,
)
from tests.kernels.test_cuda_variants import assert_variant_close, make_sinks

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda


def forms_key(head_dims):
    """info's name of a (q/k, v) row: "128", or "192/128" where v's head dim differs."""
    d, dv = head_dims
    return str(d) if d == dv else f"{d}/{dv}"


# The (q/k, v) rows whose top-k kernels the library built (config.h's topk column; info's forms).
TOPK_HEAD_DIMS = [
    tuple(pair)
    for pair in ops.BUILD_INFO["paged_kernels"].get("head_dim_pairs", [])
    if "topk" in ops.BUILD_INFO["paged_kernels"]["forms"].get(forms_key(pair), [])
]


def head_dims_id(head_dims):
    """A test id: "128", or "192v128"."""
    return forms_key(head_dims).replace("/", "v")


# The plan's split count, one split (each row's lone block writes it) and 7 (the merge kernel,
# some splits empty for short rows).
SPLITS = {"auto": "", "one_split": "decode_splits=1", "seven_splits": "decode_splits=7"}
# (window_left, softcap, sinks?): every variant together, and none (lse only).
VARIANTS = {"all": (700, 20.0, True), "none": (-1, None, False)}


def topk_rows(batch, topk, g, unused=0.2):
    """int32 [T, topk] on the GPU: for each new token at position p of a sequence of n keys, half
    of its entries near p (within 600 before it), a quarter anywhere up to p, a quarter anywhere in
    the sequence (past p: the causal mask hides them); drawn with replacement (repeats), 8 entries
    repeated on purpose, a fraction `unused` of -1. A sequence of length 0 lists nothing."""
    rows = []
    for n, new in zip(batch.seq_lens_list, batch.q_lens_list):
        for i in range(new):
            if n == 0:
                rows.append(torch.full((topk,), -1, dtype=torch.int64, device="cuda"))
                continue
            p = n - new + i
            near = torch.randint(max(0, p - 600), p + 1, (topk // 2,), generator=g, device="cuda")
            before = torch.randint(0, p + 1, (topk // 4,), generator=g, device="cuda")
            rest = topk - near.numel() - before.numel()
            anywhere = torch.randint(0, n, (rest,), generator=g, device="cuda")
            row = torch.cat([near, before, anywhere])
            row = row[torch.randperm(topk, generator=g, device="cuda")]
            if topk >= 16:
                row[topk - 8 :] = row[:8]
            rows.append(row)
    indices = torch.stack(rows).to(torch.int32)
    indices[torch.rand(indices.shape, generator=g, device="cuda") < unused] = -1
    return indices


def make_batch(lens, new, hq, hkv, head_dims, page_size, seed, fp8=None, dtype=torch.bfloat16):
    """head_dims: q/k's head dim, or a (q/k, v) pair."""
    d, dv = head_dims if isinstance(head_dims, tuple) else (head_dims, head_dims)
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch = PagedBatch(lens, new, hq, hkv, d, page_size, dtype, generator=g, head_dim_v=dv)
    if fp8 is not None:
        batch = Fp8Batch(batch, fp8, g)
    return batch, g


def run(batch, q, indices, decode, scale, window_left=-1, softcap=None, sinks=None, **extra):
    """(out, lse) of the cuda op over the batch, with topk_indices (None: a dense call)."""
    poison_next_allocation(output_shape(batch, q), q.dtype)
    return cuda_op(
        q,
        batch.k_cache,
        batch.v_cache,
        extra.pop("block_table", batch.block_table),
        extra.pop("seq_lens", batch.seq_lens),
        None if decode else batch.query_start_loc,
        1 if decode else extra.pop("max_query_len", max(batch.q_lens_list)),
        decode,
        extra.pop("attn_mask", None),
        True,
        scale,
        window_left,
        softcap,
        sinks,
        True,
        batch.k_scale,
        batch.v_scale,
        topk_indices=indices,
    )


def variant_arguments(variant, hq, g):
    window_left, softcap, sinks = VARIANTS[variant]
    return dict(
        window_left=window_left, softcap=softcap, sinks=make_sinks(hq, g) if sinks else None
    )


def assert_topk_matches_and_ignoring_it_would_not(batch, indices, decode, scale, variants):
    out, lse = run(batch, batch.q, indices, decode, scale, **variants)
    assert out.shape == output_shape(batch, batch.q)
    ref_out, ref_lse = reference(
        batch, batch.q, True, scale, topk_indices=indices, return_lse=True, **variants
    )
    assert_variant_close(out, lse, ref_out, ref_lse, batch.q.dtype)
    # Control: the same call without the indices (every key its mask allows) is far from it.
    dense, _ = run(batch, batch.q, None, decode, scale, **variants)
    assert (dense.double() - ref_out).abs().max().item() > 0.05


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["16bit", "e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("head_dims", TOPK_HEAD_DIMS, ids=head_dims_id)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits", list(SPLITS))
def test_decode_reads_the_listed_keys_with_every_variant(
    splits, variant, head_dims, page_size, fp8, tuning
):
    """300 entries a row (not a whole number of tiles), over sequences of 5 to 3000 keys."""
    tuning(SPLITS[splits])
    d = head_dims[0]
    lens = [5, 1500, 3000, 130, 2049]
    batch, g = make_batch(lens, [1] * 5, 8, 2, head_dims, page_size, d + page_size, fp8)
    indices = topk_rows(batch, 300, g)
    variants = variant_arguments(variant, 8, g)
    assert_topk_matches_and_ignoring_it_would_not(
        batch, indices, True, 1.0 / math.sqrt(d), variants
    )


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["16bit", "e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("head_dims", TOPK_HEAD_DIMS, ids=head_dims_id)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits", list(SPLITS))
def test_ragged_prefill_reads_the_listed_keys_with_every_variant(
    splits, variant, head_dims, page_size, fp8, tuning
):
    """Ragged new tokens over cached prefixes (one without, one of a single token): each token
    its own row of 200 entries, the causal edge its own."""
    tuning(SPLITS[splits])
    d = head_dims[0]
    prefixes, new = [0, 300, 2000, 10, 777], [17, 5, 40, 1, 64]
    lens = [p + n for p, n in zip(prefixes, new)]
    batch, g = make_batch(lens, new, 8, 2, head_dims, page_size, 3 * d + page_size, fp8)
    indices = topk_rows(batch, 200, g)
    variants = variant_arguments(variant, 8, g)
    assert_topk_matches_and_ignoring_it_would_not(
        batch, indices, False, 1.0 / math.sqrt(d), variants
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1), (40, 2)], ids=["mha", "group8", "group20"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_every_group_size_and_dtype(decode, hq, hkv, dtype):
    """The q heads of a kv head share the gathered keys as the decode packs its group: MHA, 8,
    and 20 (two row tiles of 16)."""
    new = [1, 1, 1] if decode else [9, 3, 20]
    lens = [n + p for n, p in zip(new, (40, 2500, 700))]
    batch, g = make_batch(lens, new, hq, hkv, 128, 16, hq * 10 + hkv, dtype=dtype)
    indices = topk_rows(batch, 256, g)
    assert_topk_matches_and_ignoring_it_would_not(
        batch, indices, decode, 1.0 / math.sqrt(128), variant_arguments("all", hq, g)
    )


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_a_bool_mask_and_the_listed_keys_both_apply(decode):
    """attn_mask [T, K] (K shorter than some sequences: positions past it are masked) and the
    indices: a row sees the listed keys its mask row allows."""
    new = [1, 1, 1] if decode else [4, 2, 7]
    lens = [n + p for n, p in zip(new, (300, 1200, 60))]
    batch, g = make_batch(lens, new, 8, 2, 128, 16, 53)
    indices = topk_rows(batch, 256, g)
    mask = torch.rand(batch.num_tokens, 1000, generator=g, device="cuda") < 0.6
    scale = 1.0 / math.sqrt(128)
    out, lse = run(batch, batch.q, indices, decode, scale, attn_mask=mask)
    ref_out, ref_lse = reference(
        batch, batch.q, True, scale, mask, topk_indices=indices, return_lse=True
    )
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)
    unmasked, _ = run(batch, batch.q, indices, decode, scale)
    assert (unmasked.double() - ref_out).abs().max().item() > 0.05


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["16bit", "e4m3"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    "head_dims", [p for p in TOPK_HEAD_DIMS if p in ((128, 128), (192, 128))], ids=head_dims_id
)
def test_2048_entries_over_long_contexts(head_dims, decode, fp8):
    """DeepSeek V3.2's shape: 2048 entries a row over contexts of 8192 to 20000 keys (its MHA
    form's head dims, 192/128, and 128)."""
    new = [1, 1] if decode else [6, 3]
    lens = [8192, 20000]
    batch, g = make_batch(lens, new, 16, 1, head_dims, 64, 2048, fp8)
    indices = topk_rows(batch, 2048, g, unused=0.05)
    assert_topk_matches_and_ignoring_it_would_not(
        batch, indices, decode, 1.0 / math.sqrt(head_dims[0]), variant_arguments("none", 16, g)
    )


def test_a_key_listed_many_times_counts_once():
    """A row listing one position 64 times (in several tiles) is the row listing it once; one
    listing every key of its sequence twice is the dense decode."""
    batch, g = make_batch([100, 90], [1, 1], 8, 2, 128, 16, 5)
    scale = 1.0 / math.sqrt(128)
    once = torch.full((2, 256), -1, dtype=torch.int32, device="cuda")
    once[:, 0] = 7
    many = once.clone()
    many[:, ::4] = 7
    a, a_lse = run(batch, batch.q, once, True, scale)
    b, b_lse = run(batch, batch.q, many, True, scale)
    assert torch.equal(a, b) and torch.equal(a_lse, b_lse)
    ref_out, ref_lse = reference(batch, batch.q, True, scale, topk_indices=once, return_lse=True)
    assert_variant_close(a, a_lse, ref_out, ref_lse, torch.bfloat16)
    twice = torch.arange(200, device="cuda", dtype=torch.int32).remainder(
        torch.tensor([[100], [90]], device="cuda", dtype=torch.int32)
    )
    out, lse = run(batch, batch.q, twice, True, scale)
    dense, dense_lse = run(batch, batch.q, None, True, scale)
    ref_out, ref_lse = reference(batch, batch.q, True, scale, return_lse=True)
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)
    assert_variant_close(dense, dense_lse, ref_out, ref_lse, torch.bfloat16)


def test_rows_that_list_nothing_visible_are_zeros_or_their_sink():
    """Only -1, or only keys past the causal edge or outside the window: out 0 and lse -inf; with
    sinks, out 0 and lse the sink's logit."""
    batch, g = make_batch([50, 3000], [4, 2], 8, 2, 128, 16, 8)
    scale = 1.0 / math.sqrt(128)
    indices = torch.full((6, 64), -1, dtype=torch.int32, device="cuda")
    indices[4, :3] = torch.tensor([2999, 2999, 5], dtype=torch.int32)  # the next token's; window
    sinks = make_sinks(8, g)
    for extra in ({}, {"sinks": sinks}):
        out, lse = run(batch, batch.q, indices, False, scale, window_left=100, **extra)
        assert torch.equal(out, torch.zeros_like(out))
        expected = sinks.expand(6, 8) if extra else torch.full_like(lse, -math.inf)
        assert torch.allclose(lse, expected.float(), atol=1e-5)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    "bad", ["minus_two", "very_negative", "the_length", "far_past", "page_outside_the_pool"]
)
def test_a_bad_entry_makes_its_own_row_nan_and_leaves_the_others_right(bad, decode, tuning):
    """Unchecked (no host synchronisation): the token whose row lists a bad entry is NaN in every
    head, out and lse; the other tokens (of its own sequence too) are right, and a decode padding
    slot (length 0) is zeros whatever it lists. With the plan's splits and with 5."""
    new = [1, 1, 1, 1] if decode else [3, 5, 2, 4]
    lens = [700, 900, 0 if decode else 4, 2000]
    batch, g = make_batch(lens, new, 8, 2, 128, 16, 31)
    scale = 1.0 / math.sqrt(128)
    indices = topk_rows(batch, 128, g)
    victim = 1 if decode else 5  # sequence 1's one token, or its second
    table = batch.block_table.clone()
    value = {"minus_two": -2, "very_negative": -(1 << 30), "the_length": 900, "far_past": 1 << 30}
    if bad == "page_outside_the_pool":
        # Sequence 1's last page (positions 896-899) leaves the pool: only the victim lists a
        # position on it, 896, which it sees (the prefill's victim sits at 897).
        seq1 = slice(1, 2) if decode else slice(3, 8)
        indices[seq1] = torch.where(indices[seq1] >= 896, -1, indices[seq1])
        table[1, 896 // 16] = batch.k_cache.shape[0]  # one past the pool
    corrupt = indices.clone()
    corrupt[victim, 10] = 896 if bad == "page_outside_the_pool" else value[bad]
    if decode:
        corrupt[2, :5] = torch.tensor([3, -7, 1 << 20, 0, -1], dtype=torch.int32)  # padding slot
    for splits in ("", "decode_splits=5"):
        tuning(splits)
        out, lse = run(batch, batch.q, corrupt, decode, scale, block_table=table)
        assert torch.isnan(out[victim]).all() and torch.isnan(lse[victim]).all()
        # The padding slot's reference lists nothing (its row lists garbage): zeros both.
        others = [t for t in range(batch.num_tokens) if t != victim]
        ref_out, ref_lse = reference(
            batch, batch.q, True, scale, topk_indices=indices, return_lse=True
        )
        assert_variant_close(
            out[others], lse[others], ref_out[others], ref_lse[others], torch.bfloat16
        )
        if decode:
            assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.fixture
def checked():
    ops.set_metadata_checks(True)
    yield
    ops.set_metadata_checks(False)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_checked_mode_names_the_bad_entry(decode, checked):
    new = [1, 1] if decode else [2, 3]
    batch, g = make_batch([700, 900], new, 8, 2, 128, 16, 37)
    indices = topk_rows(batch, 64, g)
    row = 1 if decode else 3
    indices[row, 5] = 900
    with pytest.raises(ValueError, match=rf"topk_indices: entry 5 of query row {row} is 900"):
        run(batch, batch.q, indices, decode, None)


def test_prefill_rows_past_max_query_len_are_nan_as_a_prefills():
    """A sequence with more new tokens than max_query_len (unchecked metadata): all of its rows
    NaN, the other sequences' right."""
    batch, g = make_batch([40, 600], [3, 6], 8, 2, 128, 16, 9)
    indices = topk_rows(batch, 64, g)
    scale = 1.0 / math.sqrt(128)
    out, lse = run(batch, batch.q, indices, False, scale, max_query_len=4)
    assert torch.isnan(out[3:]).all()
    ref_out, ref_lse = reference(batch, batch.q, True, scale, topk_indices=indices, return_lse=True)
    assert_variant_close(out[:3], lse[:3], ref_out[:3], ref_lse[:3], torch.bfloat16)


@pytest.mark.parametrize("splits", ["", "decode_splits=1", "decode_splits=9"])
def test_cuda_graph_replay_with_changing_indices_and_lengths(splits, tuning):
    """One captured decode step replayed as the sequences grow and their rows change: the listing
    scratch, the split count and the workspace come from shapes, the rest is read on the device."""
    tuning(splits)
    hq, hkv, d, page, topk = 16, 2, 128, 16, 512
    batch, g = make_batch([4096] * 4, [1] * 4, hq, hkv, d, page, 41)
    # Finite values in the whole pool: every replay makes more of it visible.
    batch.k_cache.copy_(torch.randn(batch.k_cache.shape, generator=g, device="cuda"))
    batch.v_cache.copy_(torch.randn(batch.v_cache.shape, generator=g, device="cuda"))
    static_lens = torch.tensor([3, 1, 17, 100], dtype=torch.int32, device="cuda")
    static_q = batch.q.clone()
    static_indices = torch.zeros(4, topk, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(d)
    sinks = make_sinks(hq, g)

    def step():
        return cuda_op(
            static_q,
            batch.k_cache,
            batch.v_cache,
            batch.block_table,
            static_lens,
            None,
            1,
            True,
            None,
            True,
            scale,
            window_left=1000,
            sinks=sinks,
            return_lse=True,
            topk_indices=static_indices,
        )

    graph, (static_out, static_lse) = captured_graph(step)
    for lens in ([3, 1, 17, 100], [64, 65, 700, 1000], [2048, 129, 4000, 4096]):
        batch.seq_lens_list = lens
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        static_indices.copy_(topk_rows(batch, topk, g))
        static_q.copy_(torch.randn(static_q.shape, generator=g, device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = reference(
            batch,
            static_q,
            True,
            scale,
            window_left=1000,
            sinks=sinks,
            topk_indices=static_indices,
            return_lse=True,
        )
        assert_variant_close(static_out, static_lse, ref_out, ref_lse, torch.bfloat16)


def test_a_sequences_rows_are_the_same_bits_alone_and_in_a_batch_in_batch_invariant_mode():
    """Batch-invariant mode: splits of 16 entry tiles whatever the batch. The control: by default
    the token alone takes more splits than in the batch, and other bits."""
    batch, g = make_batch([5000, 300, 4000] + [2000] * 61, [1] * 64, 32, 8, 128, 16, 43)
    alone = PagedBatch([5000], [1], 32, 8, 128, 16, torch.bfloat16, generator=g)
    alone.k_cache, alone.v_cache = batch.k_cache, batch.v_cache
    alone.block_table = batch.block_table[:1]
    alone.seq_lens = batch.seq_lens[:1]
    alone.q = batch.q[:1]
    indices = topk_rows(batch, 2048, g, unused=0.0)
    scale = 1.0 / math.sqrt(128)

    def both():
        together, together_lse = run(batch, batch.q, indices, True, scale)
        single, single_lse = run(alone, alone.q, indices[:1], True, scale)
        return together[:1], together_lse[:1], single, single_lse

    with batch_invariant(True):
        a, a_lse, b, b_lse = both()
        assert torch.equal(a, b) and torch.equal(a_lse, b_lse)
    a, a_lse, b, b_lse = both()
    assert not (torch.equal(a, b) and torch.equal(a_lse, b_lse))


def test_the_resolver_runs_topk_calls_on_the_cuda_kernels_and_the_plan_names_the_form():
    batch, g = make_batch([3000, 40], [1, 1], 32, 8, 128, 16, 47)
    indices = topk_rows(batch, 2048, g)
    args = dict(
        k_cache=batch.k_cache,
        v_cache=batch.v_cache,
        block_table=batch.block_table,
        seq_lens=batch.seq_lens,
        max_query_len=1,
        mode="decode",
        is_causal=True,
        topk_indices=indices,
    )
    assert '"backend": "cuda"' in torch.ops.astr.explain(batch.q, **args)
    assert torch.ops.astr.cuda_paged_plan(batch.q, **args).startswith("topk/split x")
    out = torch.ops.astr.attention(batch.q, **args)
    ref = reference(batch, batch.q, True, None, topk_indices=indices)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-2


def test_a_tree_mask_and_the_listed_keys_both_apply():
    """A verify's drafts (tree_mask over each sequence's new tokens) with indices: a draft sees
    the listed keys of its cached prefix and of the drafts its tree names."""
    from tests.kernels.test_cuda_tree_verify import tree_batch

    batch, tree_mask, g = tree_batch([0, 37, 3000], [16, 2, 7], 8, 2, 128, 16, torch.bfloat16, 61)
    indices = topk_rows(batch, 256, g)
    scale = 1.0 / math.sqrt(128)
    poison_next_allocation(batch.q.shape, batch.q.dtype)
    args = (batch, batch.q, indices, False, scale)
    out, lse = batch_cuda_op(
        batch,
        batch.q,
        max(batch.q_lens_list),
        False,
        None,
        True,
        scale,
        return_lse=True,
        tree_mask=tree_mask,
        topk_indices=indices,
    )
    ref_out, ref_lse = reference(
        batch, batch.q, True, scale, tree_mask=tree_mask, topk_indices=indices, return_lse=True
    )
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)
    causal, _ = run(*args)  # the causal triangle among the drafts in place of the tree
    assert (causal.double() - ref_out).abs().max().item() > 0.05
