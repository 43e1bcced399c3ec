"""The attention variants through the one entry point, on the CPU (torch_native, the reference):
sliding window, logit softcap, attention sinks, the log-sum-exp output, and merge_states.

Every expectation is the float64 reference (tests/reference.py), written from the definitions
(csrc/kernels/paged_attention/params.h): s = scale * q.k, then c * tanh(s / c) with a softcap;
a query at position p sees keys max(0, p - W) .. p; the softmax runs over the visible keys plus
one sink logit per q head (no value); lse is the log of its denominator. Each comparison has a
control: the same comparison with the variant dropped must fail.
"""

from __future__ import annotations

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
