"""What the benchmark counts: the bytes a decode moves and the FLOPs a causal prefill does."""

import pytest
import torch
from harness import (
    causal_prefill_flops,
    decode_bytes,
    ragged_mix,
    ragged_prefill_flops,
    visible_pairs,
)


def causal_mask_pairs(prefix: int, chunk: int) -> int:
    """Pairs a lower-right causal mask lets through, counted from the mask itself."""
    keys = torch.arange(prefix + chunk)[None, :]
    queries = prefix + torch.arange(chunk)[:, None]
    return int((keys <= queries).sum())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "batch,length,hq,hkv,head_dim", [(1, 32768, 32, 8, 128), (3, 40, 4, 2, 16)]
)
def test_decode_bytes_are_what_the_step_reads_and_writes(
    batch, length, hq, hkv, head_dim, kv_dtype
):
    q = torch.empty(batch, hq, head_dim, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, length, hkv, head_dim, dtype=kv_dtype, device="meta")
    moved = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()  # K, V; q, out
    assert decode_bytes(batch, length, hq, hkv, head_dim, k.element_size()) == moved


def test_causal_prefill_flops_count_half_the_square_of_scores():
    batch, heads, seq, head_dim = 2, 32, 4096, 128
    # Two matmuls (QK^T, PV) of 2 FLOPs per multiply-add, over S * S / 2 (query, key) pairs.
    assert causal_prefill_flops(batch, heads, seq, head_dim) == 4 * batch * heads * head_dim * (
        seq * seq // 2
    )


def test_visible_pairs_match_the_mask():
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 50, (6,), generator=gen).tolist()
    chunk = torch.randint(1, 40, (6,), generator=gen).tolist()
    brute = sum(causal_mask_pairs(p, c) for p, c in zip(prefix, chunk))
    assert visible_pairs(prefix, chunk) == brute
    assert visible_pairs([0], [8]) == 36  # square causal: S(S+1)/2


def test_ragged_flops_are_four_d_h_per_visible_pair():
    pairs = causal_mask_pairs(0, 4) + causal_mask_pairs(5, 3)
    assert ragged_prefill_flops([0, 5], [4, 3], 2, 16) == 4 * 16 * 2 * pairs


def test_ragged_mix_is_drawn_from_its_ranges_and_its_seed_alone():
    torch.manual_seed(123)  # the global generator must not matter
    prefix, chunk = ragged_mix(0, 8, (0, 4096), (256, 2048))
    torch.manual_seed(456)
    assert ragged_mix(0, 8, (0, 4096), (256, 2048)) == (prefix, chunk)
    assert len(prefix) == len(chunk) == 8
    assert all(0 <= p <= 4096 for p in prefix) and all(256 <= c <= 2048 for c in chunk)
    assert ragged_mix(1, 8, (0, 4096), (256, 2048)) != (prefix, chunk)
