"""Tree masks (speculative decoding's verify of a tree of drafts) through the one entry point, on
the CPU (torch_native, the reference), against the float64 reference (tests/reference.py) written
from the definition (kernels/paged_attention/params.h):

    new token i of a sequence (row t of q) sees every cached position before the sequence's new
    tokens, and new token j of the same sequence exactly where tree_mask[t, j] is true; window,
    softcap, sinks, lse and an FP8 cache apply as usual.

Random trees of 2 to 16 drafts per sequence over ragged cached prefixes, page sizes 1, 16 and 256,
with window + softcap + sinks + an FP8 cache together (the combination a peer got wrong). Each
comparison has a control: the same call with the tree ignored (the causal triangle) is far from
the tree's reference. The argument's rules: bool [T, max_query_len], paged prefill only, with
is_causal, not with attn_mask; errors name tree_mask.
"""

from __future__ import annotations

import math

import pytest
import torch

import astrai.extension as ae
from astrai.extension import PagedKVCache
from tests.reference import (
    pack_tree_masks,
    paged_reference,
    quantize,
    random_tree_parents,
    tree_of_drafts,
)


def paged_call(
    prefixes,
    drafts,
    *,
    page_size,
    q_heads,
    kv_heads,
    head_dim,
    dtype,
    g,
    cache_dtype=None,
    extra_width=1,
):
    """A paged prefill call (the op's arguments) over shuffled pages: sequence b has prefixes[b]
    cached tokens and drafts[b] new ones, each with a random tree. cache_dtype: an FP8 pool (with
    per-head scales). Returns (arguments, trees)."""
    lengths = [p + n for p, n in zip(prefixes, drafts)]
    pages = [max(1, math.ceil(n / page_size)) for n in lengths]
    num_pages = sum(pages) + 3
    width = max(pages) + extra_width
    order = torch.randperm(num_pages, generator=g)
    table = torch.randint(0, num_pages, (len(lengths), width), generator=g, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[start : start + n].int()
        start += n
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    args = {}
    if cache_dtype is not None:
        args["k_scale"] = (torch.rand(kv_heads, generator=g) + 0.5) / 100
        args["v_scale"] = (torch.rand(kv_heads, generator=g) + 0.5) / 100
        k_cache = quantize(k_cache, args["k_scale"], cache_dtype)
        v_cache = quantize(v_cache, args["v_scale"], cache_dtype)
    starts = [0]
    for n in drafts:
        starts.append(starts[-1] + n)
    trees = [tree_of_drafts(random_tree_parents(n, g)) for n in drafts]
    max_query_len = max(drafts)
    args.update(
        q=torch.randn(starts[-1], q_heads, head_dim, generator=g).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table,
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max_query_len,
        mode="prefill",
        is_causal=True,
        tree_mask=pack_tree_masks(trees, max_query_len),
    )
    return args, trees


def reference_of(args, **variants):
    return paged_reference(
        args["q"],
        args["k_cache"],
        args["v_cache"],
        args["block_table"],
        args["seq_lens"],
        args["query_start_loc"],
        is_causal=True,
        k_scale=args.get("k_scale"),
        v_scale=args.get("v_scale"),
        return_lse=True,
        **variants,
    )


TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    tolerance = TOLERANCE[dtype]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def far_from(out, ref_out):
    return (out.double() - ref_out).abs().max().item() > 1e-2


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_random_trees_over_ragged_prefixes_match_the_definition(page_size, head_dim, dtype):
    g = torch.Generator().manual_seed(page_size * 1000 + head_dim)
    prefixes, drafts = [0, 37, 300, 5], [16, 2, 7, 11]
    args, trees = paged_call(
        prefixes,
        drafts,
        page_size=page_size,
        q_heads=8,
        kv_heads=2,
        head_dim=head_dim,
        dtype=dtype,
        g=g,
    )
    out, lse = torch.ops.astr.attention(**args, backend="torch_native", return_lse=True)
    ref_out, ref_lse = reference_of(args, tree_mask=args["tree_mask"])
    assert_matches(out, lse, ref_out, ref_lse, dtype)
    # Control: ignoring the tree (the causal triangle among the drafts) gives another answer.
    causal = {k: v for k, v in args.items() if k != "tree_mask"}
    plain = torch.ops.astr.attention(**causal, backend="torch_native")
    assert far_from(plain, ref_out)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_tree_with_window_softcap_sinks_and_an_fp8_cache_together(cache_dtype, page_size):
    """The combination where a peer computed wrong results: every variant at once."""
    g = torch.Generator().manual_seed(7 + page_size)
    prefixes, drafts = [200, 3, 90, 600], [8, 16, 2, 5]
    args, _ = paged_call(
        prefixes,
        drafts,
        page_size=page_size,
        q_heads=8,
        kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        g=g,
        cache_dtype=cache_dtype,
    )
    sinks = torch.randn(8, generator=g) * 2
    variants = dict(window_left=40, softcap=3.0, sinks=sinks)
    out, lse = torch.ops.astr.attention(**args, **variants, backend="torch_native", return_lse=True)
    ref_out, ref_lse = reference_of(args, tree_mask=args["tree_mask"], **variants)
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)
    causal = {k: v for k, v in args.items() if k != "tree_mask"}
    plain = torch.ops.astr.attention(**causal, **variants, backend="torch_native")
    assert far_from(plain, ref_out)


def test_a_window_cuts_drafts_as_it_cuts_the_prefix():
    """Draft 5 of a chain sits at position prefix + 5; window_left=2 lets it see positions
    prefix + 3 .. prefix + 5 only, whatever the tree names."""
    g = torch.Generator().manual_seed(3)
    args, _ = paged_call(
        [50], [6], page_size=4, q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float64, g=g
    )
    args["tree_mask"] = torch.ones(6, 6, dtype=torch.bool).tril()  # a chain: the causal triangle
    out = torch.ops.astr.attention(**args, window_left=2, backend="torch_native")
    ref = reference_of(args, tree_mask=args["tree_mask"], window_left=2)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    causal = {k: v for k, v in args.items() if k != "tree_mask"}
    plain = torch.ops.astr.attention(**causal, window_left=2, backend="torch_native")
    torch.testing.assert_close(out, plain, atol=1e-12, rtol=1e-12)  # a chain is causal


def test_the_lower_triangle_is_the_causal_mask_and_a_draft_may_see_a_later_one():
    g = torch.Generator().manual_seed(5)
    args, _ = paged_call(
        [9, 0], [5, 7], page_size=2, q_heads=4, kv_heads=2, head_dim=16, dtype=torch.float64, g=g
    )
    causal = {k: v for k, v in args.items() if k != "tree_mask"}
    lower = pack_tree_masks(
        [torch.ones(5, 5, dtype=torch.bool).tril(), torch.ones(7, 7, dtype=torch.bool).tril()], 7
    )
    triangle = torch.ops.astr.attention(**dict(args, tree_mask=lower), backend="torch_native")
    torch.testing.assert_close(triangle, torch.ops.astr.attention(**causal, backend="torch_native"))
    # Every draft sees every draft of its sequence (the definition: exactly where it is true).
    full = torch.ones(12, 7, dtype=torch.bool)
    out = torch.ops.astr.attention(**dict(args, tree_mask=full), backend="torch_native")
    ref = reference_of(args, tree_mask=full)[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_a_draft_that_names_no_draft_sees_its_prefix_alone():
    g = torch.Generator().manual_seed(11)
    args, _ = paged_call(
        [20], [4], page_size=8, q_heads=2, kv_heads=2, head_dim=8, dtype=torch.float64, g=g
    )
    args["tree_mask"] = torch.zeros(4, 4, dtype=torch.bool)
    out = torch.ops.astr.attention(**args, backend="torch_native")
    torch.testing.assert_close(out, reference_of(args, tree_mask=args["tree_mask"])[0])
    # ... and with no prefix, nothing: zeros, lse -inf.
    args, _ = paged_call(
        [0], [3], page_size=8, q_heads=2, kv_heads=2, head_dim=8, dtype=torch.float64, g=g
    )
    args["tree_mask"] = torch.zeros(3, 3, dtype=torch.bool)
    out, lse = torch.ops.astr.attention(**args, backend="torch_native", return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_a_wider_mask_is_read_up_to_max_query_len():
    g = torch.Generator().manual_seed(13)
    args, _ = paged_call(
        [10, 4], [3, 5], page_size=4, q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float64, g=g
    )
    wider = torch.cat([args["tree_mask"], torch.ones(8, 4, dtype=torch.bool)], dim=1)
    out = torch.ops.astr.attention(**dict(args, tree_mask=wider), backend="torch_native")
    torch.testing.assert_close(out, reference_of(args, tree_mask=args["tree_mask"])[0])


def test_a_verify_step_through_the_python_api_and_a_paged_kv_cache():
    """The engines' call: a cache with prompts cached, then one step of a tree of drafts per
    sequence (tree_mask [T, step.max_query_len])."""
    g = torch.Generator().manual_seed(17)
    hq, hkv, d = 4, 2, 16
    cache = PagedKVCache(1, 64, 16, hkv, d, dtype=torch.float32)
    prompts = [23, 5]
    cache.begin_step([0, 1], prompts)
    k = torch.randn(1, sum(prompts), hkv, d, generator=g)
    v = torch.randn(1, sum(prompts), hkv, d, generator=g)
    q = torch.randn(1, sum(prompts), hq, d, generator=g)
    ae.attention(q, k, v, kv_cache=cache, fwd="prefill", is_causal=True)
    parents = [[-1, 0, 0, 1], [-1, -1, 1, 2, 2, 0]]
    trees = [tree_of_drafts(p) for p in parents]
    step = cache.begin_step([0, 1], [4, 6])
    tree_mask = pack_tree_masks(trees, step.max_query_len)
    kn = torch.randn(1, 10, hkv, d, generator=g)
    vn = torch.randn(1, 10, hkv, d, generator=g)
    qn = torch.randn(1, 10, hq, d, generator=g)
    out = ae.attention(
        qn, kn, vn, kv_cache=cache, fwd="prefill", is_causal=True, tree_mask=tree_mask
    )
    assert out.shape == qn.shape
    ref = paged_reference(
        qn[0],
        cache.k_pools[0],
        cache.v_pools[0],
        step.block_table,
        step.seq_lens,
        step.query_start_loc,
        is_causal=True,
        tree_mask=tree_mask,
    )
    torch.testing.assert_close(out[0].double(), ref, atol=2e-5, rtol=2e-5)
    plain = torch.ops.astr.attention(
        qn[0],
        k_cache=cache.k_pools[0],
        v_cache=cache.v_pools[0],
        block_table=step.block_table,
        seq_lens=step.seq_lens,
        query_start_loc=step.query_start_loc,
        max_query_len=6,
        mode="prefill",
        is_causal=True,
    )
    assert far_from(plain, ref)


def base_args(**overrides):
    g = torch.Generator().manual_seed(19)
    args, _ = paged_call(
        [8, 3], [3, 4], page_size=4, q_heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, g=g
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tree_mask=torch.ones(7, 4, dtype=torch.int32)), "tree_mask: expected a bool tensor"),
        (
            dict(tree_mask=torch.ones(6, 4, dtype=torch.bool)),
            r"\[tokens, max_query_len\] = \[7, 4\]",
        ),
        (dict(tree_mask=torch.ones(7, 3, dtype=torch.bool)), r"got Bool of shape \[7, 3\]"),
        (dict(tree_mask=torch.ones(7, dtype=torch.bool)), "tree_mask: expected a bool tensor"),
        (dict(is_causal=False), "tree_mask: needs is_causal=True"),
        (dict(attn_mask=torch.ones(7, 12, dtype=torch.bool)), "tree_mask, attn_mask: give one"),
    ],
)
def test_bad_tree_masks_raise_naming_the_argument(overrides, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.astr.attention(**base_args(**overrides))


def test_a_tree_mask_is_for_paged_prefill_calls_only():
    q = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError, match="tree_mask: only for paged calls with mode='prefill'"):
        ae.attention(q, q, q, is_causal=True, tree_mask=torch.ones(3, 3, dtype=torch.bool))
    cache = PagedKVCache(1, 8, 4, 2, 8, dtype=torch.float32)
    cache.begin_step([0, 1], [1, 1])
    x = torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError, match="got a decode call"):
        ae.attention(x, x, x, kv_cache=cache, fwd="decode", tree_mask=torch.ones(2, 1, dtype=bool))
    assert cache.seq_len(0) == 1 and bool((cache.k_pools[0] == 0).all())  # refused: nothing written


def test_the_flash_backend_refuses_it_and_the_others_take_it():
    from astrai.extension import ops

    args = base_args()
    decision = torch.ops.astr.explain(**args)
    assert "tree_mask not supported by the flash backend" in decision
    assert '"backend": "torch_native"' in decision
    assert ops.BUILD_INFO["variants"]["tree_mask"] == {
        "cuda": True,
        "flash": False,
        "torch_native": True,
    }


def test_explain_and_the_python_api_accept_what_the_op_accepts_with_a_loose_bound():
    """max_query_len may be any bound at or above the longest sequence's new tokens, and one past
    the call's token count counts as that count: a tree mask as wide as the tokens passes explain
    (the Python API's check before appending) as it passes the op."""
    args = base_args(max_query_len=100, tree_mask=torch.ones(7, 7, dtype=torch.bool))
    assert '"backend": "torch_native"' in torch.ops.astr.explain(**args)
    out = torch.ops.astr.attention(**args)
    assert out.shape == (7, 2, 8)
