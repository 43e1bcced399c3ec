"""astrai.compat.flash_attn against flash-attn's documented semantics, written out in float64
(``flash_reference``) on fresh random inputs. Each convention has a control that fails if it is
ignored: bottom-right causal against top-left, ``cache_seqlens`` before the append against after
it, the natural-log LSE against base 2. The GPU tests compare with the flash-attn package itself
where it is installed."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.compat.flash_attn import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

TOLERANCE = 2e-5  # float32 inputs against the float64 reference


def flash_reference(
    q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, top_left=False
):
    """flash-attn's definition for one batch: q [B, Lq, H, D], k/v [B, Lk, Hk, D]. Query i sees
    keys in [i + Lk - Lq - left, i + Lk - Lq + right] (-1 unbounded; causal: right = 0); a row
    that sees no key is 0 with LSE -inf (astrai's value; flash-attn 2 reports +inf). Returns
    (out [B, Lq, H, D], lse [B, H, Lq], natural log). ``top_left``: the other convention, for
    the controls."""
    q, k, v = q.double(), k.double(), v.double()
    batch, q_len, heads, dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window
    if causal:
        right = 0
    offset = 0 if top_left else k_len - q_len
    rows = torch.arange(q_len)[:, None] + offset
    keys = torch.arange(k_len)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if left >= 0:
        visible &= keys >= rows - left
    if right >= 0:
        visible &= keys <= rows + right
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Lq]
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    return out, lse


def randn(*shape, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float32)


def close(got, want, tolerance=TOLERANCE):
    return torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance)


def assert_close(got, want, tolerance=TOLERANCE):
    error = (got.double() - want).abs().max().item()
    assert error < tolerance, f"max error {error:.2e}"


# -- flash_attn_func --------------------------------------------------------------------------


@pytest.mark.parametrize("q_len, k_len", [(17, 17), (5, 23), (23, 5), (1, 9)])
def test_causal_is_aligned_bottom_right(q_len, k_len):
    g = torch.Generator().manual_seed(q_len * 100 + k_len)
    q = randn(2, q_len, 4, 16, generator=g)
    k, v = randn(2, k_len, 2, 16, generator=g), randn(2, k_len, 2, 16, generator=g)
    out = flash_attn_func(q, k, v, causal=True)
    want, _ = flash_reference(q, k, v, causal=True)
    assert_close(out, want)
    if q_len != k_len:  # control: the top-left mask (SDPA's) gives another answer
        top_left, _ = flash_reference(q, k, v, causal=True, top_left=True)
        assert not close(out, top_left)


def test_a_query_that_sees_no_key_returns_zeros():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        randn(1, 6, 2, 8, generator=g),
        randn(1, 3, 2, 8, generator=g),
        randn(1, 3, 2, 8, generator=g),
    )
    out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))  # rows 0..2 see keys < 0
    assert torch.isneginf(lse[:, :, :3]).all()
    want, want_lse = flash_reference(q, k, v, causal=True)
    assert_close(out, want)
    assert_close(lse[:, :, 3:], want_lse[:, :, 3:])


@pytest.mark.parametrize(
    "causal, window",
    [
        (True, (4, -1)),
        (False, (3, 2)),
        (False, (-1, 0)),
        (False, (2, -1)),
        (False, (-1, 3)),
        (True, (0, 5)),
    ],
)
@pytest.mark.parametrize("q_len, k_len", [(12, 12), (7, 19)])
def test_window_size_left_right(causal, window, q_len, k_len):
    g = torch.Generator().manual_seed(7 + q_len)
    q = randn(2, q_len, 4, 16, generator=g)
    k, v = randn(2, k_len, 4, 16, generator=g), randn(2, k_len, 4, 16, generator=g)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window)
    want, _ = flash_reference(q, k, v, causal=causal, window=window)
    assert_close(out, want)
    unwindowed, _ = flash_reference(q, k, v, causal=causal)  # control: the window is applied
    assert not close(out, unwindowed)


def test_softcap_and_softmax_scale():
    g = torch.Generator().manual_seed(11)
    q = randn(2, 9, 4, 32, generator=g) * 3
    k, v = randn(2, 9, 4, 32, generator=g) * 3, randn(2, 9, 4, 32, generator=g)
    out = flash_attn_func(q, k, v, softmax_scale=0.3, softcap=4.0, causal=True)
    want, _ = flash_reference(q, k, v, causal=True, softcap=4.0, scale=0.3)
    assert_close(out, want)
    uncapped, _ = flash_reference(q, k, v, causal=True, scale=0.3)
    assert not close(out, uncapped)


def test_return_softmax_lse_is_batch_heads_queries_in_natural_log():
    g = torch.Generator().manual_seed(13)
    q = randn(3, 5, 4, 16, generator=g)
    k, v = randn(3, 11, 2, 16, generator=g), randn(3, 11, 2, 16, generator=g)
    out, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    want, want_lse = flash_reference(q, k, v, causal=True)
    assert lse.shape == (3, 4, 5) and lse.dtype == torch.float32
    assert_close(out, want)
    assert_close(lse, want_lse)
    assert not close(lse, want_lse / math.log(2))  # control: base 2 is another number


def test_gradients_match_the_reference():
    g = torch.Generator().manual_seed(17)
    q = randn(2, 6, 4, 16, generator=g).requires_grad_()
    k = randn(2, 10, 2, 16, generator=g).requires_grad_()
    v = randn(2, 10, 2, 16, generator=g).requires_grad_()
    grad = randn(2, 6, 4, 16, generator=g)
    got = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), grad)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(flash_reference(*exact, causal=True)[0], exact, grad.double())
    for a, b in zip(got, want):
        assert_close(a, b, 1e-4)


@pytest.mark.parametrize(
    "arguments, named",
    [
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
        (dict(return_attn_probs=True), "return_attn_probs"),
    ],
)
def test_what_astrai_cannot_honour_raises_naming_it(arguments, named):
    q = torch.randn(1, 4, 4, 16)
    with pytest.raises(NotImplementedError, match=named):
        flash_attn_func(q, q, q, **arguments)


def test_deterministic_is_accepted_where_it_changes_nothing():
    q = torch.randn(1, 4, 4, 16, requires_grad=True)
    out = flash_attn_func(q, q, q, deterministic=True)  # CPU: the backward is deterministic
    assert out.shape == q.shape


# -- flash_attn_varlen_func -------------------------------------------------------------------


def packed(lengths, heads, dim, generator):
    tokens = randn(sum(lengths), heads, dim, generator=generator)
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    return tokens, cu


def varlen_reference(q, k, v, cu_q, cu_k, **options):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
        out, lse = flash_reference(qs[None], ks[None], vs[None], **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)  # [total_q, H, D], [H, total_q]


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=True),
        dict(),
        dict(causal=True, window=(3, -1)),
        dict(window=(2, 1)),
        dict(causal=True, softcap=3.0),
    ],
)
def test_varlen_per_sequence_bottom_right(options):
    g = torch.Generator().manual_seed(19)
    q_lens, k_lens = [3, 1, 7, 4], [10, 1, 7, 12]
    q, cu_q = packed(q_lens, 4, 16, g)
    k, cu_k = packed(k_lens, 2, 16, g)
    v, _ = packed(k_lens, 2, 16, g)
    window = options.pop("window", (-1, -1))
    out, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(q_lens),
        max(k_lens),
        window_size=window,
        return_softmax_lse=True,
        **options,
    )
    want, want_lse = varlen_reference(q, k, v, cu_q, cu_k, window=window, **options)
    assert out.shape == q.shape and lse.shape == (4, sum(q_lens))
    assert_close(out, want)
    assert_close(lse, want_lse)
    if options.get("causal"):
        top_left, _ = varlen_reference(q, k, v, cu_q, cu_k, window=window, top_left=True, **options)
        assert not close(out, top_left)


def test_varlen_over_a_paged_cache_with_block_table():
    g = torch.Generator().manual_seed(23)
    page, k_lens, q_lens = 4, [9, 14], [2, 5]
    k_pool, v_pool = randn(12, page, 2, 16, generator=g), randn(12, page, 2, 16, generator=g)
    block_table = torch.tensor([[7, 2, 9, 0], [1, 11, 4, 5]], dtype=torch.int32)
    q, cu_q = packed(q_lens, 4, 16, g)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    out = flash_attn_varlen_func(
        q,
        k_pool,
        v_pool,
        cu_q,
        cu_k,
        max(q_lens),
        max(k_lens),
        causal=True,
        block_table=block_table,
    )
    gathered_k = torch.cat([k_pool[block_table[b]].flatten(0, 1)[:n] for b, n in enumerate(k_lens)])
    gathered_v = torch.cat([v_pool[block_table[b]].flatten(0, 1)[:n] for b, n in enumerate(k_lens)])
    want, _ = varlen_reference(q, gathered_k, gathered_v, cu_q, cu_k, causal=True)
    assert_close(out, want)


# -- flash_attn_with_kvcache ------------------------------------------------------------------


def filled_cache(batch, length, kv_heads, dim, generator):
    return randn(batch, length, kv_heads, dim, generator=generator), randn(
        batch, length, kv_heads, dim, generator=generator
    )


@pytest.mark.parametrize("q_len", [1, 3])
def test_kvcache_appends_after_cache_seqlens_then_attends(q_len):
    g = torch.Generator().manual_seed(29 + q_len)
    k_cache, v_cache = filled_cache(3, 64, 2, 16, g)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    cached = torch.tensor([5, 17, 0], dtype=torch.int32)
    q = randn(3, q_len, 4, 16, generator=g)
    k_new, v_new = randn(3, q_len, 2, 16, generator=g), randn(3, q_len, 2, 16, generator=g)
    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k_new,
        v=v_new,
        cache_seqlens=cached,
        causal=True,
        return_softmax_lse=True,
    )
    assert out.shape == q.shape and lse.shape == (3, 4, q_len)
    for b, n in enumerate(cached.tolist()):
        # written in place at n .. n + q_len - 1, nothing else touched
        assert torch.equal(k_cache[b, n : n + q_len], k_new[b])
        assert torch.equal(v_cache[b, n : n + q_len], v_new[b])
        assert torch.equal(k_cache[b, :n], before_k[b, :n])
        assert torch.equal(k_cache[b, n + q_len :], before_k[b, n + q_len :])
        keys = torch.cat([before_k[b, :n], k_new[b]])[None]
        values = torch.cat([before_v[b, :n], v_new[b]])[None]
        want, want_lse = flash_reference(q[b : b + 1], keys, values, causal=True)
        assert_close(out[b : b + 1], want)
        assert_close(lse[b : b + 1], want_lse)
        # control: cache_seqlens read as the length after the append attends over n keys only
        if n >= q_len:
            after, _ = flash_reference(q[b : b + 1], keys[:, :n], values[:, :n], causal=True)
            assert not close(out[b : b + 1], after)


def test_kvcache_without_new_tokens_attends_over_cache_seqlens():
    g = torch.Generator().manual_seed(31)
    k_cache, v_cache = filled_cache(2, 32, 2, 16, g)
    q = randn(2, 1, 4, 16, generator=g)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7)  # an int: every row
    want, _ = flash_reference(q, k_cache[:, :7], v_cache[:, :7])
    assert_close(out, want)


def test_kvcache_cache_batch_idx_picks_the_cache_rows():
    g = torch.Generator().manual_seed(37)
    k_cache, v_cache = filled_cache(4, 32, 2, 16, g)
    before_k = k_cache.clone()
    rows = torch.tensor([3, 0], dtype=torch.int32)
    cached = torch.tensor([9, 4], dtype=torch.int32)
    q = randn(2, 1, 4, 16, generator=g)
    k_new, v_new = randn(2, 1, 2, 16, generator=g), randn(2, 1, 2, 16, generator=g)
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=cached, cache_batch_idx=rows
    )
    for b, (row, n) in enumerate(zip(rows.tolist(), cached.tolist())):
        assert torch.equal(k_cache[row, n], k_new[b, 0])
        want, _ = flash_reference(
            q[b : b + 1], k_cache[row : row + 1, : n + 1], v_cache[row : row + 1, : n + 1]
        )
        assert_close(out[b : b + 1], want)
    assert torch.equal(k_cache[1], before_k[1]) and torch.equal(k_cache[2], before_k[2])


def test_kvcache_over_a_paged_cache():
    g = torch.Generator().manual_seed(41)
    page = 8
    k_pool, v_pool = randn(10, page, 2, 16, generator=g), randn(10, page, 2, 16, generator=g)
    block_table = torch.tensor([[4, 1, 8], [0, 6, 2]], dtype=torch.int32)
    cached = torch.tensor([8, 13], dtype=torch.int32)  # sequence 0's new token opens page 1
    q = randn(2, 2, 4, 16, generator=g)
    k_new, v_new = randn(2, 2, 2, 16, generator=g), randn(2, 2, 2, 16, generator=g)
    out = flash_attn_with_kvcache(
        q,
        k_pool,
        v_pool,
        k=k_new,
        v=v_new,
        cache_seqlens=cached,
        block_table=block_table,
        causal=True,
        window_size=(6, 0),
    )
    for b, n in enumerate(cached.tolist()):
        keys = k_pool[block_table[b]].flatten(0, 1)[: n + 2][None]
        values = v_pool[block_table[b]].flatten(0, 1)[: n + 2][None]
        assert torch.equal(keys[0, n:], k_new[b])
        want, _ = flash_reference(q[b : b + 1], keys, values, causal=True, window=(6, 0))
        assert_close(out[b : b + 1], want)


def test_kvcache_refused_call_writes_nothing():
    g = torch.Generator().manual_seed(43)
    k_cache, v_cache = filled_cache(2, 16, 2, 16, g)
    before = k_cache.clone()
    q = randn(2, 1, 3, 16, generator=g)  # 3 query heads over 2 kv heads: refused
    k_new, v_new = randn(2, 1, 2, 16, generator=g), randn(2, 1, 2, 16, generator=g)
    with pytest.raises(RuntimeError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=3)
    assert torch.equal(k_cache, before)


def test_kvcache_without_room_raises_before_writing():
    g = torch.Generator().manual_seed(47)
    k_cache, v_cache = filled_cache(2, 16, 2, 16, g)
    before = k_cache.clone()
    q = randn(2, 2, 4, 16, generator=g)
    k_new, v_new = randn(2, 2, 2, 16, generator=g), randn(2, 2, 2, 16, generator=g)
    with pytest.raises(ValueError, match="cache must have room"):
        flash_attn_with_kvcache(
            q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=torch.tensor([3, 15]).int()
        )
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    "arguments, named",
    [
        (dict(rotary_cos=torch.ones(4, 4), rotary_sin=torch.ones(4, 4)), "rotary_cos"),
        (dict(cache_leftpad=torch.zeros(1, dtype=torch.int32)), "cache_leftpad"),
        (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    ],
)
def test_kvcache_what_astrai_cannot_honour_raises_naming_it(arguments, named):
    k_cache = torch.zeros(1, 8, 4, 16)
    with pytest.raises(NotImplementedError, match=named):
        flash_attn_with_kvcache(
            torch.randn(1, 1, 4, 16), k_cache, k_cache, cache_seqlens=2, **arguments
        )


# -- against the flash-attn package itself ----------------------------------------------------


def _flash_attn():
    return pytest.importorskip("flash_attn", reason="the flash-attn package is not installed")


@pytest.mark.cuda
@pytest.mark.parametrize(
    "q_len, k_len, causal, window",
    [(64, 64, True, (-1, -1)), (16, 80, True, (-1, -1)), (32, 96, False, (8, 4))],
)
def test_flash_attn_func_matches_the_package(q_len, k_len, causal, window):
    package = _flash_attn()
    g = torch.Generator(device="cuda").manual_seed(53)
    q = torch.randn(2, q_len, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, k_len, 2, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, k_len, 2, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    ours = flash_attn_func(q, k, v, causal=causal, window_size=window)
    theirs = package.flash_attn_func(q, k, v, causal=causal, window_size=window)
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_flash_attn_with_kvcache_matches_the_package():
    package = _flash_attn()
    g = torch.Generator(device="cuda").manual_seed(59)
    shape = (4, 512, 2, 128)
    k_cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    theirs_k, theirs_v = k_cache.clone(), v_cache.clone()
    cached = torch.tensor([100, 3, 400, 0], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 1, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(4, 1, 2, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(4, 1, 2, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    ours, our_lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=k_new,
        v=v_new,
        cache_seqlens=cached,
        causal=True,
        return_softmax_lse=True,
    )
    theirs, their_lse = package.flash_attn_with_kvcache(
        q,
        theirs_k,
        theirs_v,
        k=k_new,
        v=v_new,
        cache_seqlens=cached,
        causal=True,
        return_softmax_lse=True,
    )
    torch.testing.assert_close(k_cache, theirs_k)
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(our_lse, their_lse, atol=2e-2, rtol=2e-2)
