"""astrai.compat.flashinfer.merge_state takes and returns FlashInfer's base-2 log-sum-exp:
merging two partial attentions over disjoint keys gives the attention over both, against a
float64 reference; the control shows a natural-log LSE would give another answer."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.compat.flashinfer import merge_state


def partial(q, k, v):
    """float64 attention of q [T, H, D] over k/v [S, H, D]: out [T, H, D] and the base-2 LSE
    [T, H] of the scaled scores, as FlashInfer defines it."""
    scores = torch.einsum("thd,shd->ths", q.double(), k.double()) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("ths,shd->thd", torch.exp(scores - lse[..., None]), v.double())
    return out, lse / math.log(2)


def test_merge_state_in_base_two_equals_attention_over_both_halves():
    g = torch.Generator().manual_seed(61)
    q = torch.randn(12, 4, 32, generator=g)
    k, v = torch.randn(50, 4, 32, generator=g), torch.randn(50, 4, 32, generator=g)
    out_a, s_a = partial(q, k[:20], v[:20])
    out_b, s_b = partial(q, k[20:], v[20:])
    whole, s_whole = partial(q, k, v)
    merged, s_merged = merge_state(out_a.float(), s_a.float(), out_b.float(), s_b.float())
    assert s_merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_merged.double(), s_whole, atol=1e-5, rtol=1e-5)
    # control: the same LSEs read as natural logs weigh the halves differently
    wrong, _ = torch.ops.astr.merge_states(out_a.float(), s_a.float(), out_b.float(), s_b.float())
    assert not torch.allclose(wrong.double(), whole, atol=1e-3)


def test_a_side_that_saw_nothing_weighs_zero():
    g = torch.Generator().manual_seed(67)
    v_a = torch.randn(3, 2, 8, generator=g)
    s_a = torch.randn(3, 2, generator=g)
    v_b = torch.full((3, 2, 8), float("nan"))
    s_b = torch.full((3, 2), float("-inf"))
    merged, s = merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(merged, v_a)
    torch.testing.assert_close(s, s_a)


def test_merge_state_refuses_an_lse_that_is_not_float32():
    v = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="s_a: expected a float32"):
        merge_state(v, torch.zeros(2, 2, dtype=torch.float64), v, torch.zeros(2, 2))
