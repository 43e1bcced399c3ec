"""GPU tests of tree masks and the verify form (a prefill-mode call of a few new tokens per
sequence run by the decode forms, whose rows pack (new token, q head) pairs): every decode form as
a verify and every prefill kernel, against the float64 reference (tests/reference.py):

    new token i of a sequence (row t of q) sees its sequence's cached prefix and new token j where
    tree_mask[t, j]; window, softcap, sinks, lse and an FP8 cache apply as usual.

Random trees of 2 to 16 drafts over ragged cached prefixes, page sizes 1, 16 and 256, every head
dim, window + softcap + sinks + an FP8 cache together; each with a control that fails if the tree
is ignored. CUDA-graph replay with changing trees and lengths. Pools hold NaN in every slot no
sequence owns and outputs are poisoned first (test_cuda_kernels.py).
"""

import math

import pytest
import torch

from tests.kernels.conftest import batch_cuda_op, captured_graph, cuda_op
from tests.kernels.test_cuda_fp8 import Fp8Batch
from tests.kernels.test_cuda_kernels import (
    HEAD_DIMS,
    TOLERANCE,
    PagedBatch,
    poison_next_allocation,
    reference,
)
from tests.kernels.test_cuda_variants import assert_variant_close, make_sinks
from tests.reference import pack_tree_masks, random_tree_parents, tree_of_drafts

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda

# Every form a tree mask runs on: the decode forms as a verify (verify_form=always; a forced form
# that cannot run here falls back to the plan's choice) and the prefill kernels (verify_form=never;
# likewise), FP8 pages read in the kernel or dequantized first.
FORMS = {
    "verify": "verify_form=always",
    "verify_one_split": "verify_form=always,decode_splits=1",
    "verify_eight_warps": "verify_form=always,decode_splits=1,decode_form=eight_warps",
    "verify_block_pairs": "verify_form=always,decode_splits=2,decode_form=block_pairs",
    "verify_cluster": "verify_form=always,decode_splits=2,decode_form=cluster",
    "verify_merge_kernel": "verify_form=always,decode_splits=2,decode_form=split",
    "verify_7_splits": "verify_form=always,decode_splits=7",
    "prefill_warp_specialized": "verify_form=never,prefill_kernel=warp_specialized",
    "prefill_gather": "verify_form=never,prefill_kernel=warp_specialized,prefill_loads=cp_async",
    "prefill_persistent": "verify_form=never,prefill_kernel=persistent,persistent_blocks=3",
    "prefill_wgmma": "verify_form=never,prefill_kernel=wgmma,fp8_prefill=in_kernel",
    "prefill_mma_sync": "verify_form=never,prefill_kernel=mma_sync,fp8_prefill=in_kernel",
    "prefill_dequantized": "verify_form=never,prefill_kernel=mma_sync,fp8_prefill=dequantize_first",
}


def tree_batch(prefixes, drafts, hq, hkv, head_dim, page_size, dtype, seed, fp8=None):
    """A PagedBatch of prefixes[b] cached tokens and drafts[b] new ones per sequence, each with a
    random tree of drafts; -> (batch, tree_mask [T, max drafts] on the GPU, the generator)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = [p + n for p, n in zip(prefixes, drafts)]
    batch = PagedBatch(lens, drafts, hq, hkv, head_dim, page_size, dtype, generator=g)
    if fp8 is not None:
        batch = Fp8Batch(batch, fp8, g)
    cpu = torch.Generator().manual_seed(seed)
    trees = [tree_of_drafts(random_tree_parents(n, cpu)) for n in drafts]
    return batch, pack_tree_masks(trees, max(drafts)).cuda(), g


def run(batch, q, tree_mask, scale, window_left=-1, softcap=None, sinks=None):
    poison_next_allocation(q.shape, q.dtype)
    return batch_cuda_op(
        batch,
        q,
        max(batch.q_lens_list),
        False,
        None,
        True,
        scale,
        window_left,
        softcap,
        sinks,
        True,
        batch.k_scale,
        batch.v_scale,
        tree_mask=tree_mask,
    )


@pytest.mark.parametrize("fp8", [None, torch.float8_e4m3fn], ids=["16bit", "e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("form", list(FORMS))
def test_trees_with_every_variant_match_the_reference_in_every_form(
    form, head_dim, page_size, fp8, tuning
):
    """Window + softcap + sinks (+ an FP8 cache) with random trees of 2 to 16 drafts over ragged
    prefixes (one shorter than the window, one empty, one long enough for many splits)."""
    tuning(FORMS[form])
    prefixes, drafts = [0, 37, 3000, 300, 5], [16, 2, 7, 11, 4]
    batch, tree_mask, g = tree_batch(
        prefixes, drafts, 8, 2, head_dim, page_size, torch.bfloat16, head_dim * 7 + page_size, fp8
    )
    scale = 1.0 / math.sqrt(head_dim)
    sinks = make_sinks(8, g)
    variants = dict(window_left=700, softcap=20.0, sinks=sinks)
    out, lse = run(batch, batch.q, tree_mask, scale, **variants)
    ref_out, ref_lse = reference(
        batch, batch.q, True, scale, tree_mask=tree_mask, return_lse=True, **variants
    )
    assert_variant_close(out, lse, ref_out, ref_lse, torch.bfloat16)
    # Control: the causal triangle in place of the tree is far from the tree's reference.
    plain, _ = run(batch, batch.q, None, scale, **variants)
    assert (plain.double() - ref_out).abs().max().item() > 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8, 12])
@pytest.mark.parametrize("drafts", [2, 4, 8, 16])
def test_verify_without_a_tree_is_the_causal_prefill(drafts, group, dtype, tuning):
    """The verify form's rows: drafts x group per kv head in 16-row tiles (group 12: a token's
    rows straddle two tiles); causal, no tree, against the reference and the prefill kernel."""
    g = torch.Generator(device="cuda").manual_seed(drafts * 100 + group)
    lens = [drafts + p for p in (0, 100, 2500, 17)]
    batch = PagedBatch(lens, [drafts] * 4, 2 * group, 2, 128, 16, dtype, generator=g)
    scale = 1.0 / math.sqrt(128)
    ref_out, ref_lse = reference(batch, batch.q, True, scale, return_lse=True)
    for form in ("verify_form=always", "verify_form=never"):
        tuning(form)
        out, lse = run(batch, batch.q, None, scale)
        assert_variant_close(out, lse, ref_out, ref_lse, dtype)


def test_verify_rows_past_max_query_len_are_nan_as_a_prefills():
    """A sequence with more new tokens than max_query_len (unchecked metadata): all of its rows
    NaN, the other sequences' right (query_rows.cuh's poison, after the verify's merge)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    batch = PagedBatch([40, 600], [3, 6], 8, 2, 128, 16, torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(128)
    for splits in ("decode_splits=1", "decode_splits=4"):
        torch.ops.astr.set_kernel_tuning("verify_form=always," + splits)
        try:
            poison_next_allocation(batch.q.shape, batch.q.dtype)
            out, _ = batch_cuda_op(
                batch,
                batch.q,
                4,
                False,
                None,
                True,
                scale,
            )
        finally:
            torch.ops.astr.set_kernel_tuning("")
        assert torch.isnan(out[3:]).all()
        ref = reference(batch, batch.q, True, scale)
        err = (out[:3].double() - ref[:3]).norm() / ref[:3].norm()
        assert err < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("form", ["verify", "verify_merge_kernel", "prefill_mma_sync"])
def test_cuda_graph_replay_with_changing_trees_and_lengths(form, tuning):
    """One captured verify step (tree_mask, q and seq_lens in static buffers), replayed with new
    trees of 4 drafts as the sequences grow: no host synchronisation, the trees read on the
    device."""
    tuning(FORMS[form])
    g = torch.Generator(device="cuda").manual_seed(29)
    cpu = torch.Generator().manual_seed(29)
    hq, hkv, d, drafts = 32, 8, 128, 4
    batch = PagedBatch([4096] * 3, [drafts] * 3, hq, hkv, d, 16, torch.bfloat16, generator=g)
    batch.k_cache.copy_(torch.randn(batch.k_cache.shape, generator=g, device="cuda"))
    batch.v_cache.copy_(torch.randn(batch.v_cache.shape, generator=g, device="cuda"))
    static_lens = torch.tensor([5, 30, 1000], dtype=torch.int32, device="cuda")
    static_q = batch.q.clone()
    static_tree = torch.ones(3 * drafts, drafts, dtype=torch.bool, device="cuda")
    scale = 1.0 / math.sqrt(d)

    def step():
        return cuda_op(
            static_q,
            batch.k_cache,
            batch.v_cache,
            batch.block_table,
            static_lens,
            batch.query_start_loc,
            drafts,
            False,
            None,
            True,
            scale,
            255,
            None,
            None,
            True,
            tree_mask=static_tree,
        )

    graph, (static_out, static_lse) = captured_graph(step)
    for lens in ([5, 30, 1000], [64, 700, 2048], [4096, 129, 3000]):
        trees = [tree_of_drafts(random_tree_parents(drafts, cpu)) for _ in range(3)]
        static_tree.copy_(pack_tree_masks(trees, drafts))
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(torch.randn(static_q.shape, generator=g, device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        batch.seq_lens_list = lens
        ref_out, ref_lse = reference(
            batch, static_q, True, scale, tree_mask=static_tree, window_left=255, return_lse=True
        )
        assert_variant_close(static_out, static_lse, ref_out, ref_lse, torch.bfloat16)
