"""The reference every peer is checked against, itself checked against the definition."""

import pytest
import torch
from harness import reference_attention, rel_l2

from tests.reference import dense_reference


def attention_by_definition(q, k, v, mask):
    """tests/reference.py's attention of [B, H, L, D] tensors (the benchmark's layout)."""
    blhd = (t.transpose(1, 2) for t in (q, k, v))
    return dense_reference(*blhd, attn_mask=mask).transpose(1, 2)


@pytest.fixture
def gqa_inputs():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k = torch.randn(2, 2, 7, 8, generator=gen)
    v = torch.randn(2, 2, 7, 8, generator=gen)
    mask = torch.arange(7)[None, :] <= 2 + torch.arange(5)[:, None]  # lower-right causal
    return q, k, v, mask


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_reference_is_attention_by_definition(gqa_inputs, dtype, tolerance):
    q, k, v, mask = gqa_inputs
    expected = attention_by_definition(q, k, v, mask)
    got = reference_attention(q, k, v, attn_mask=mask, dtype=dtype)
    assert got.dtype == dtype
    assert rel_l2(got, expected) < tolerance
    # Control: the same comparison without the mask fails.
    unmasked = reference_attention(q, k, v, dtype=dtype)
    assert rel_l2(unmasked, expected) > 1e-2


def test_causal_reference_is_the_upper_left_mask_on_a_square():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    mask = torch.arange(6)[None, :] <= torch.arange(6)[:, None]
    expected = attention_by_definition(q, k, v, mask)
    assert (
        rel_l2(reference_attention(q, k, v, is_causal=True, dtype=torch.float64), expected) < 1e-12
    )


def test_reference_in_chunks_equals_reference_in_one(monkeypatch, gqa_inputs):
    q, k, v, mask = gqa_inputs
    whole = reference_attention(q, k, v, attn_mask=mask, dtype=torch.float64)
    monkeypatch.setattr("harness.REFERENCE_BUDGET", 1)  # one head of one sequence at a time
    chunked = reference_attention(q, k, v, attn_mask=mask, dtype=torch.float64)
    assert rel_l2(chunked, whole) < 1e-14
