"""The attention variants through the one entry point, on the CPU (torch_native, the reference):
sliding window, logit softcap, attention sinks, the log-sum-exp output, and merge_states.

Every expectation is the float64 reference (tests/reference.py), written from the definitions
(csrc/kernels/paged_attention/params.h): s = scale * q.k, then c * tanh(s / c) with a softcap;
a query at position p sees keys max(0, p - W) .. p; the softmax runs over the visible keys plus
one sink logit per q head (no value); lse is the log of its denominator. Each comparison has a
control: the same comparison with the variant dropped must fail.
"""

from __future__ import annotations

import json

import pytest
import torch

import astrai.extension as ae
from astrai.extension import PagedKVCache
from tests.reference import dense_reference, sequence_reference

torch.manual_seed(0)


def close(a, b, tol):
    finite = torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), finite):
        return False
    return bool(((a.double() - b.double())[finite]).abs().max() <= tol) if finite.any() else True


def dense_inputs(batch=2, lq=9, lk=9, hq=4, hkv=2, d=16, dtype=torch.float64):
    q = torch.randn(batch, lq, hq, d, dtype=dtype)
    k = torch.randn(batch, lk, hkv, d, dtype=dtype)
    v = torch.randn(batch, lk, hkv, d, dtype=dtype)
    return q, k, v


VARIANTS = [
    dict(window_left=3),
    dict(window_left=0),
    dict(softcap=2.0),
    dict(sinks=True),
    dict(window_left=4, softcap=3.0, sinks=True),
]


def materialize(variant, hq):
    v = dict(variant)
    if v.pop("sinks", False):
        v["sinks"] = (torch.randn(hq) * 2).float()
    return v


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(sorted(v)))
def test_dense_variants_match_the_definition(variant):
    q, k, v = dense_inputs()
    args = materialize(variant, q.shape[2])
    out, lse = ae.attention(q, k, v, is_causal=True, return_lse=True, **args)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    ref_out, ref_lse = dense_reference(q, k, v, is_causal=True, return_lse=True, **args)
    for b in range(q.shape[0]):
        assert close(out[b], ref_out[b], 1e-10)
        assert close(lse[b], ref_lse[b], 1e-5)
    # Control: without the variant the same comparison fails.
    plain = ae.attention(q, k, v, is_causal=True)
    assert not close(plain[0], ref_out[0], 1e-6)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "+".join(sorted(v)))
@pytest.mark.parametrize("fwd", ["prefill", "decode"])
def test_paged_variants_match_the_definition_over_ragged_batches(variant, fwd):
    """Cached prefixes, a ragged batch, page size 4, shuffled pages; the new tokens sit at
    seq_len - q_len + i."""
    hq, hkv, d, page = 4, 2, 16, 4
    args = materialize(variant, hq)
    cache = PagedKVCache(1, 64, page, hkv, d, dtype=torch.float64)
    cache._free_pages = list(torch.randperm(64).tolist())  # shuffled page order
    prefixes = [5, 0, 13]
    history = {}
    cache.begin_step([0, 1, 2], [p if p else 1 for p in prefixes])
    for s in (0, 1, 2):
        history[s] = torch.randn(prefixes[s] or 1, hkv, d, dtype=torch.float64)
    k = torch.cat([history[s] for s in (0, 1, 2)])[None]
    ae.attention(
        k.new_zeros(1, k.shape[1], hq, d),
        k,
        k.clone(),
        kv_cache=cache,
        fwd="prefill",
        is_causal=True,
    )
    values = {s: history[s].clone() for s in (0, 1, 2)}  # the same tensors went in as k and v
    new = [1, 1, 1] if fwd == "decode" else [3, 1, 6]
    cache.begin_step([0, 1, 2], new)
    kn = torch.randn(1, sum(new), hkv, d, dtype=torch.float64)
    vn = torch.randn(1, sum(new), hkv, d, dtype=torch.float64)
    q = torch.randn(1, sum(new), hq, d, dtype=torch.float64)
    out, lse = ae.attention(
        q, kn, vn, kv_cache=cache, fwd=fwd, is_causal=True, return_lse=True, **args
    )
    start = 0
    for s, n in enumerate(new):
        keys = torch.cat([history[s], kn[0, start : start + n]])
        vals = torch.cat([values[s], vn[0, start : start + n]])
        ref_out, ref_lse = sequence_reference(
            q[0, start : start + n], keys, vals, is_causal=True, return_lse=True, **args
        )
        assert close(out[0, start : start + n], ref_out, 1e-10)
        assert close(lse[0, start : start + n], ref_lse, 1e-5)
        start += n


def test_window_requires_causal_and_softcap_must_be_positive():
    q, k, v = dense_inputs()
    with pytest.raises(ValueError, match="window_left: needs is_causal=True"):
        ae.attention(q, k, v, window_left=2)
    with pytest.raises(ValueError, match="window_left: expected -1"):
        ae.attention(q, k, v, is_causal=True, window_left=-5)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            ae.attention(q, k, v, softcap=bad)
    with pytest.raises(ValueError, match=r"sinks: expected a float32 tensor of shape \[q_heads\]"):
        ae.attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        ae.attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float64))


def test_a_row_that_sees_no_key_gives_zeros_and_lse_minus_inf_or_its_sink():
    q, k, v = dense_inputs(lq=3, lk=5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1] = False
    out, lse = ae.attention(q, k, v, attn_mask=mask, return_lse=True)
    assert (out[:, 1] == 0).all() and torch.isneginf(lse[:, 1]).all()
    sinks = torch.randn(4)
    out, lse = ae.attention(q, k, v, attn_mask=mask, return_lse=True, sinks=sinks)
    assert (out[:, 1] == 0).all()
    assert torch.allclose(lse[:, 1], sinks.expand(2, 4))


def test_merge_states_of_two_halves_equals_one_attention_over_the_union():
    q, k, v = dense_inputs(lq=6, lk=11)
    full, full_lse = ae.attention(q, k, v, return_lse=True)
    a, a_lse = ae.attention(q, k[:, :4], v[:, :4], return_lse=True)
    b, b_lse = ae.attention(q, k[:, 4:], v[:, 4:], return_lse=True)
    out, lse = ae.merge_states(a, a_lse, b, b_lse)
    # lse is float32 by contract: the merge weights carry its precision.
    assert torch.allclose(out, full, atol=1e-6) and torch.allclose(lse, full_lse, atol=1e-5)
    # Control: averaging the halves is not the union.
    assert not torch.allclose((a + b) / 2, full, atol=1e-3)


def test_merge_states_handles_rows_that_saw_nothing_on_one_or_both_sides():
    out_a = torch.randn(3, 4, 8)
    out_b = torch.randn(3, 4, 8)
    lse_a = torch.randn(3, 4)
    lse_b = torch.randn(3, 4)
    lse_a[0] = float("-inf")
    out_a[0] = 0
    lse_b[1] = float("-inf")
    out_b[1] = 0
    lse_a[2], lse_b[2] = float("-inf"), float("-inf")
    out_a[2], out_b[2] = 0, 0
    out, lse = ae.merge_states(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(out[0], out_b[0]) and torch.allclose(lse[0], lse_b[0])
    assert torch.allclose(out[1], out_a[1]) and torch.allclose(lse[1], lse_a[1])
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    assert torch.isfinite(out).all()


def test_merge_states_rejects_mismatched_arguments():
    out = torch.randn(2, 3, 8)
    lse = torch.randn(2, 3)
    with pytest.raises(ValueError, match="lse_b: expected shape"):
        ae.merge_states(out, lse, out, lse[:, :2])
    with pytest.raises(ValueError, match="lse_a: expected float32"):
        ae.merge_states(out, lse.double(), out, lse)
    with pytest.raises(ValueError, match="out_b: expected the shape of out_a"):
        ae.merge_states(out, lse, out[:1], lse)


def test_gradients_through_window_softcap_and_sinks():
    torch.manual_seed(1)
    q, k, v = (t.requires_grad_(True) for t in dense_inputs(batch=1, lq=5, lk=5, hq=2, hkv=1, d=4))
    sinks = torch.randn(2, dtype=torch.float32, requires_grad=True)

    def f(q, k, v, sinks):
        out, lse = ae.attention(
            q, k, v, is_causal=True, window_left=2, softcap=1.5, sinks=sinks, return_lse=True
        )
        return out, lse

    # sinks is float32 by contract: check its gradient against finite differences separately.
    assert torch.autograd.gradcheck(lambda q, k, v: f(q, k, v, sinks.detach())[0], (q, k, v))
    out, lse = f(q, k, v, sinks)
    (out.sum() + lse.sum()).backward()
    grad = sinks.grad.clone()
    eps = 1e-3
    for h in range(2):
        bumped = sinks.detach().clone()
        bumped[h] += eps
        up = f(q.detach(), k.detach(), v.detach(), bumped)
        bumped[h] -= 2 * eps
        down = f(q.detach(), k.detach(), v.detach(), bumped)
        numeric = ((up[0].sum() + up[1].sum()) - (down[0].sum() + down[1].sum())) / (2 * eps)
        assert abs(numeric.item() - grad[h].item()) < 1e-2 * max(1.0, abs(numeric.item()))
    assert grad.abs().sum() > 0


def test_explain_names_the_variant_a_backend_lacks():
    q, k, v = dense_inputs(dtype=torch.bfloat16)
    decision = ae.explain(q, k, v, sinks=torch.zeros(4))
    assert any("sinks not supported" in r for r in decision.rejected["flash"])


def test_opcheck_on_the_variant_arguments():
    q, k, v = dense_inputs(dtype=torch.float32)
    sinks = torch.randn(4)
    torch.library.opcheck(
        torch.ops.astr.attention.default,
        (q, k, v),
        dict(is_causal=True, window_left=3, softcap=2.0, sinks=sinks),
    )
    torch.library.opcheck(
        torch.ops.astr.attention.lse,
        (q, k, v),
        dict(is_causal=True, window_left=3, softcap=2.0, sinks=sinks, return_lse=True),
    )
    out, lse = ae.attention(q, k, v, return_lse=True)
    torch.library.opcheck(torch.ops.astr.merge_states.default, (out, lse, out, lse))


def test_compile_fullgraph_over_the_variant_arguments():
    q, k, v = dense_inputs(dtype=torch.float32)
    sinks = torch.randn(4)

    def step(q, k, v, sinks):
        out, lse = ae.attention(
            q, k, v, is_causal=True, window_left=3, softcap=2.0, sinks=sinks, return_lse=True
        )
        merged, merged_lse = ae.merge_states(out, lse, out, lse)
        return merged, merged_lse

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, sinks)
    want = step(q, k, v, sinks)
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)


# -- top-k indices (DeepSeek sparse attention) -------------------------------------------------
# Each query row lists the key positions it may see (int32, shared by all heads; -1: unused);
# it sees exactly the listed keys that its mask, causality and window also allow.


def random_topk(rows, length, topk, generator, unused=0.25):
    """int32 [rows, topk]: distinct positions of [0, length) per row, some entries -1."""
    picks = torch.stack(
        [torch.randperm(length, generator=generator)[:topk] for _ in range(rows)]
    ).to(torch.int32)
    picks[torch.rand(picks.shape, generator=generator) < unused] = -1
    return picks


TOPK_VARIANTS = [
    dict(),
    dict(window_left=4),
    dict(softcap=2.0, sinks=True),
    dict(window_left=3, softcap=3.0, sinks=True),
]


@pytest.mark.parametrize("variant", TOPK_VARIANTS, ids=lambda v: "+".join(sorted(v)) or "plain")
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_dense_topk_indices_match_the_definition(variant, is_causal):
    if not is_causal and "window_left" in variant:
        pytest.skip("a window needs is_causal")
    g = torch.Generator().manual_seed(3)
    q, k, v = dense_inputs(lq=7, lk=11)
    indices = random_topk(2 * 7, 11, 5, g).view(2, 7, 5)
    args = materialize(variant, q.shape[2])
    out, lse = ae.attention(
        q, k, v, is_causal=is_causal, topk_indices=indices, return_lse=True, **args
    )
    ref_out, ref_lse = dense_reference(
        q, k, v, is_causal=is_causal, topk_indices=indices, return_lse=True, **args
    )
    assert close(out, ref_out, 1e-10) and close(lse, ref_lse, 1e-5)
    # Control: the same call without the indices (dense attention) fails the comparison.
    dense = ae.attention(q, k, v, is_causal=is_causal, **args)
    assert not close(dense, ref_out, 1e-6)


def test_dense_topk_indices_combine_with_a_mask_and_pass_gradcheck():
    g = torch.Generator().manual_seed(4)
    q, k, v = (t.requires_grad_(True) for t in dense_inputs(batch=1, lq=5, lk=6, hq=2, hkv=1, d=4))
    indices = random_topk(5, 6, 3, g, unused=0.0).view(1, 5, 3)
    mask = torch.rand(5, 6, generator=g) > 0.3
    out = ae.attention(q, k, v, attn_mask=mask, topk_indices=indices)
    ref = dense_reference(q.detach(), k.detach(), v.detach(), attn_mask=mask, topk_indices=indices)
    assert close(out.detach(), ref, 1e-10)
    assert torch.autograd.gradcheck(
        lambda q, k, v: ae.attention(q, k, v, attn_mask=mask, topk_indices=indices), (q, k, v)
    )


def test_a_position_listed_twice_counts_once_and_minus_one_lists_nothing():
    q, k, v = dense_inputs(batch=1, lq=2, lk=6)
    twice = torch.tensor([[[3, 3, 5, 5], [0, 0, 0, 0]]], dtype=torch.int32)
    once = torch.tensor([[[3, 5, -1, -1], [-1, 0, -1, -1]]], dtype=torch.int32)
    assert torch.equal(
        ae.attention(q, k, v, topk_indices=twice), ae.attention(q, k, v, topk_indices=once)
    )
    nothing = torch.full((1, 2, 4), -1, dtype=torch.int32)
    out, lse = ae.attention(q, k, v, topk_indices=nothing, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("variant", TOPK_VARIANTS, ids=lambda v: "+".join(sorted(v)) or "plain")
@pytest.mark.parametrize("fwd", ["prefill", "decode"])
def test_paged_topk_indices_match_the_definition_over_ragged_batches(variant, fwd):
    """Cached prefixes, a ragged batch, page size 4, shuffled pages; each token lists positions
    within its own sequence (0 .. seq_len - 1), future ones included (causality removes them)."""
    hq, hkv, d, page = 4, 2, 16, 4
    g = torch.Generator().manual_seed(5)
    args = materialize(variant, hq)
    cache = PagedKVCache(1, 64, page, hkv, d, dtype=torch.float64)
    cache._free_pages = list(torch.randperm(64, generator=g).tolist())
    prefixes, new = [9, 3, 14], ([1, 1, 1] if fwd == "decode" else [3, 1, 6])
    keys = [torch.randn(p + n, hkv, d, dtype=torch.float64) for p, n in zip(prefixes, new)]
    values = [torch.randn(p + n, hkv, d, dtype=torch.float64) for p, n in zip(prefixes, new)]
    cache.begin_step([0, 1, 2], prefixes)
    history_k = torch.cat([key[:p] for key, p in zip(keys, prefixes)])[None]
    history_v = torch.cat([value[:p] for value, p in zip(values, prefixes)])[None]
    ae.attention(
        history_k.new_zeros(1, sum(prefixes), hq, d),
        history_k,
        history_v,
        kv_cache=cache,
        fwd="prefill",
        is_causal=True,
    )
    cache.begin_step([0, 1, 2], new)
    kn = torch.cat([key[p:] for key, p in zip(keys, prefixes)])[None]
    vn = torch.cat([value[p:] for value, p in zip(values, prefixes)])[None]
    q = torch.randn(1, sum(new), hq, d, dtype=torch.float64)
    rows = [random_topk(n, p + n, 4, g) for p, n in zip(prefixes, new)]
    out, lse = ae.attention(
        q,
        kn,
        vn,
        kv_cache=cache,
        fwd=fwd,
        is_causal=True,
        topk_indices=torch.cat(rows),
        return_lse=True,
        **args,
    )
    starts = [0, *torch.tensor(new).cumsum(0).tolist()]
    ref_out, ref_lse = (
        torch.cat(parts)
        for parts in zip(
            *(
                sequence_reference(
                    q[0, starts[s] : starts[s + 1]],
                    keys[s],
                    values[s],
                    is_causal=True,
                    topk_indices=rows[s],
                    return_lse=True,
                    **args,
                )
                for s in range(3)
            )
        )
    )
    assert close(out[0], ref_out, 1e-10) and close(lse[0], ref_lse, 1e-5)
    # Control: the same step without the indices fails the comparison.
    dense = ae.attention(q, None, None, kv_cache=cache, fwd=fwd, is_causal=True, **args)
    assert not close(dense[0], ref_out, 1e-6)


def test_topk_indices_are_checked_naming_the_argument():
    q, k, v = dense_inputs(batch=1, lq=3, lk=5)
    good = torch.zeros(1, 3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="topk_indices: expected dtype int32"):
        ae.attention(q, k, v, topk_indices=good.long())
    with pytest.raises(ValueError, match=r"topk_indices: dense calls take \[batch, q_len, topk\]"):
        ae.attention(q, k, v, topk_indices=good[0])
    for bad in (5, -2):
        indices = good.clone()
        indices[0, 1, 1] = bad
        with pytest.raises(ValueError, match=rf"topk_indices: entry 1 of query row 1 is {bad}"):
            ae.attention(q, k, v, topk_indices=indices)
    cache = PagedKVCache(1, 8, 4, 1, 16, dtype=torch.float64)
    cache.begin_step([0, 1], [3, 2])
    kn = torch.randn(1, 5, 1, 16, dtype=torch.float64)
    paged = torch.zeros(5, 2, dtype=torch.int32)
    paged[4, 0] = 2  # sequence 1 has 2 tokens: positions 0 and 1
    with pytest.raises(
        ValueError,
        match=r"entry 0 of query row 4 is 2, expected -1 \(unused\) or a key position in \[0, 2\)",
    ):
        ae.attention(
            torch.randn(1, 5, 4, 16, dtype=torch.float64),
            kn,
            kn,
            kv_cache=cache,
            fwd="prefill",
            is_causal=True,
            topk_indices=paged,
        )
    assert not cache.k_pools[0].any(), "a refused call writes nothing"


def test_an_unchecked_bad_entry_gives_nan_rows_never_finite_numbers():
    """Compiled code runs no host checks (its values are unknown while tracing): a row listing a
    position outside its sequence is NaN, every other row exact."""
    q, k, v = dense_inputs(batch=1, lq=3, lk=5)
    indices = torch.tensor([[[0, 1], [2, 9], [4, -1]]], dtype=torch.int32)
    compiled = torch.compile(
        lambda q, k, v, i: ae.attention(q, k, v, topk_indices=i),
        fullgraph=True,
        backend="aot_eager",
    )
    out = compiled(q, k, v, indices)
    assert torch.isnan(out[0, 1]).all()
    good = indices.clone()
    good[0, 1] = -1
    ref = dense_reference(q, k, v, topk_indices=good)
    assert close(out[0, 0::2], ref[0, 0::2], 1e-10)


def test_the_cuda_kernels_take_paged_topk_indices_and_flash_passes_them_by_naming_them():
    """ASTR_VARIANTS' topk row: cuda and torch_native implement it, flash does not. On the CPU the
    cuda backend is passed by for the device alone; a dense call for having no cache."""
    from astrai.extension import ops
    from tests.extension.test_tree_mask import base_args

    assert ops.BUILD_INFO["variants"]["topk_indices"] == {
        "cuda": True,
        "flash": False,
        "torch_native": True,
    }
    indices = torch.full((7, 3), -1, dtype=torch.int32)
    decision = json.loads(torch.ops.astr.explain(**base_args(topk_indices=indices)))
    assert decision["backend"] == "torch_native"
    rejected = decision["reasons"]
    assert "topk_indices not supported by the flash backend" in rejected["flash"]
    assert not any("topk_indices" in reason for reason in rejected["cuda"]), rejected["cuda"]
    assert any("needs CUDA tensors" in reason for reason in rejected["cuda"])
    q, k, v = dense_inputs(dtype=torch.bfloat16)
    dense = ae.explain(q, k, v, topk_indices=torch.zeros(2, 9, 3, dtype=torch.int32))
    assert any("needs a paged KV cache" in reason for reason in dense.rejected["cuda"])
    assert not any("topk_indices" in reason for reason in dense.rejected["cuda"])


def test_rows_wider_than_the_cuda_listing_table_pass_cuda_by_naming_their_width():
    """The top-k kernels hold a row's entries in a table of 16384 slots (plan.h): 16383 entries
    at most; the resolver passes cuda by for wider rows, naming the width."""
    from tests.extension.test_tree_mask import base_args

    wide = torch.full((7, 16384), -1, dtype=torch.int32)
    rejected = json.loads(torch.ops.astr.explain(**base_args(topk_indices=wide)))["reasons"]
    assert any(
        "topk_indices: 16384 entries per query row (the kernels take at most 16383)" in reason
        for reason in rejected["cuda"]
    ), rejected["cuda"]
    fits = torch.full((7, 16383), -1, dtype=torch.int32)
    rejected = json.loads(torch.ops.astr.explain(**base_args(topk_indices=fits)))["reasons"]
    assert not any("topk_indices" in reason for reason in rejected["cuda"])


def test_opcheck_and_compile_over_topk_indices():
    g = torch.Generator().manual_seed(6)
    q, k, v = dense_inputs(dtype=torch.float32)
    indices = random_topk(2 * 9, 9, 4, g).view(2, 9, 4)
    torch.library.opcheck(
        torch.ops.astr.attention.default, (q, k, v), dict(is_causal=True, topk_indices=indices)
    )
    torch.library.opcheck(
        torch.ops.astr.attention.lse,
        (q.requires_grad_(), k, v),
        dict(is_causal=True, window_left=3, topk_indices=indices, return_lse=True),
    )
    step = lambda q, k, v, i: ae.attention(q, k, v, is_causal=True, topk_indices=i)  # noqa: E731
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v, indices), step(q, k, v, indices), atol=1e-6)
