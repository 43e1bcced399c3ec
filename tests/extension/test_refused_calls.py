"""A paged call that the op refuses writes nothing (issue 47, item 4): the Python API decides
and validates first, then appends the new k/v, then runs. Every kind of refusal leaves the pools,
the FP8 scales and the cache's step state bit-exact, and raises what the op itself raises."""

from __future__ import annotations

import pytest
import torch

from astrai import PagedKVCache, attention, attn_backend

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
NEW_TOKENS = [2, 3]  # the refused step: two sequences extend their cached prefixes (5 tokens)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


class CacheWithoutScales(PagedKVCache):
    """An FP8 cache that hands out no scales: the op must refuse to read it."""

    def scales(self, layer_id):
        self.layer(layer_id)
        return None, None


def cache_mid_run(dtype=torch.float32, cache_type=PagedKVCache, seed=0):
    """A cache of two layers whose two sequences hold random prefixes (written through the
    API), with the next step begun: NEW_TOKENS more tokens each."""
    g = torch.Generator().manual_seed(seed)
    cache = cache_type(2, 8, 4, KV_HEADS, HEAD_DIM, dtype=dtype)
    if cache.is_fp8:
        for layer in range(2):
            cache.k_scales[layer].copy_(torch.rand(KV_HEADS, generator=g) + 0.5)
            cache.v_scales[layer].copy_(torch.rand(KV_HEADS, generator=g) + 0.5)
    cache.begin_step([0, 1], [5, 3])
    q_dtype = torch.bfloat16 if cache.is_fp8 else dtype
    for layer in range(2):
        k, v = (randn(1, 8, KV_HEADS, HEAD_DIM, g=g, dtype=q_dtype) for _ in "kv")
        if cache_type is PagedKVCache:
            q = randn(1, 8, HEADS, HEAD_DIM, g=g, dtype=q_dtype)
            attention(q, k, v, kv_cache=cache, layer_id=layer, fwd="prefill", is_causal=True)
        else:  # (its reads are refused: the prefix is written directly)
            pools = cache.k_pools[layer], cache.v_pools[layer]
            scales = cache.k_scales[layer], cache.v_scales[layer]
            torch.ops.astr.append_kv(k[0], v[0], *pools, cache.step.slot_mapping, *scales)
    cache.begin_step([0, 1], NEW_TOKENS)
    return cache


def snapshot(cache):
    """Everything a call could change: pools and scales (as bytes), the step and allocator."""
    as_bytes = [t.clone().view(torch.uint8) for t in cache.k_pools + cache.v_pools]
    scales = [t.clone() for t in cache.k_scales + cache.v_scales]
    step = cache.step
    step_tensors = [
        t.clone()
        for t in (step.block_table, step.seq_lens, step.query_start_loc, step.slot_mapping)
    ]
    allocator = (
        list(cache._free_pages),
        {s: list(p) for s, p in cache._pages.items()},
        dict(cache._lengths),
        cache._step_seq_ids,
    )
    return dict(
        pools=as_bytes,
        scales=scales,
        step=(step, step.max_query_len, step.mode),
        step_tensors=step_tensors,
        allocator=allocator,
    )


def assert_unchanged(before, cache):
    after = snapshot(cache)
    for a, b in zip(before["pools"] + before["scales"], after["pools"] + after["scales"]):
        assert torch.equal(a, b)
    assert before["step"][0] is after["step"][0] and before["step"][1:] == after["step"][1:]
    for a, b in zip(before["step_tensors"], after["step_tensors"]):
        assert torch.equal(a, b)
    assert before["allocator"] == after["allocator"]


def new_tokens(g, q_dtype=torch.float32, kv_dtype=None, tokens=5):
    kv_dtype = kv_dtype or q_dtype
    q = randn(1, tokens, HEADS, HEAD_DIM, g=g, dtype=q_dtype)
    k, v = (randn(1, tokens, KV_HEADS, HEAD_DIM, g=g, dtype=kv_dtype) for _ in "kv")
    return q, k, v


# Each refusal: the call's changes from a valid causal prefill of layer 1, and what it raises.
REFUSALS = {
    "softcap-negative": (dict(softcap=-1.0), ValueError, "^softcap: "),
    "softcap-nan": (dict(softcap=float("nan")), ValueError, "^softcap: "),
    "window-without-causal": (dict(window_left=2, is_causal=False), ValueError, "^window_left: "),
    "sinks-shape": (dict(sinks=torch.zeros(HEADS + 1)), ValueError, "^sinks: "),
    "sinks-dtype": (dict(sinks=torch.zeros(HEADS, dtype=torch.float64)), ValueError, "^sinks: "),
    "strict-argument": (dict(backend="cuda"), RuntimeError, "Explicitly-set backend 'cuda'"),
    "decode-on-a-prefill-step": (dict(fwd="decode"), RuntimeError, "^q: decode takes one token"),
    "unknown-fwd": (dict(fwd="bogus"), ValueError, "mode"),
    "q-too-few-tokens": (dict(q_tokens=4), RuntimeError, "^query_start_loc: last entry 5"),
    "q-dtype": (dict(q_dtype=torch.float64), RuntimeError, "^k_cache: expected dtype Double"),
    "q-head-dim": (dict(q_head_dim=16), RuntimeError, "^k_cache: head_dim 8"),
    "q-heads": (dict(q_heads=3), RuntimeError, r"^k_cache: q heads \(3\)"),
    "q-device": (dict(q_device="meta"), RuntimeError, "^k_cache: expected a tensor on meta"),
    "mask-rows": (dict(attn_mask=torch.ones(4, 8, dtype=torch.bool)), RuntimeError, "^attn_mask"),
    "mask-dtype": (dict(attn_mask=torch.ones(5, 8, dtype=torch.int32)), RuntimeError, "^attn_mask"),
    "scale-nan": (dict(scale=float("nan")), ValueError, "^scale: expected a finite number"),
    "scale-inf": (dict(scale=float("inf")), ValueError, "^scale: expected a finite number"),
}


def refused_call(case, g):
    """(q, k, v, keyword arguments) of the refusal ``case``."""
    changes = dict(REFUSALS[case][0])
    shape = dict(
        tokens=changes.pop("q_tokens", sum(NEW_TOKENS)),
        heads=changes.pop("q_heads", HEADS),
        head_dim=changes.pop("q_head_dim", HEAD_DIM),
    )
    q = randn(1, shape["tokens"], shape["heads"], shape["head_dim"], g=g)
    q = q.to(changes.pop("q_dtype", torch.float32)).to(changes.pop("q_device", "cpu"))
    _, k, v = new_tokens(g)
    kwargs = dict(layer_id=1, fwd="prefill", is_causal=True)
    kwargs.update(changes)
    return q, k, v, kwargs


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_paged_call_writes_nothing(case):
    cache = cache_mid_run()
    q, k, v, kwargs = refused_call(case, torch.Generator().manual_seed(1))
    before = snapshot(cache)
    error, match = REFUSALS[case][1:]
    with pytest.raises(error, match=match):
        attention(q, k, v, kv_cache=cache, **kwargs)
    assert_unchanged(before, cache)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_paged_call_raises_what_the_op_raises(case):
    """With nothing to append (k = v = None) the op itself refuses the call."""
    cache = cache_mid_run()
    q, k, v, kwargs = refused_call(case, torch.Generator().manual_seed(1))
    errors = []
    for new_k, new_v in ((k, v), (None, None)):
        with pytest.raises(Exception) as raised:
            attention(q, new_k, new_v, kv_cache=cache, **kwargs)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1]


def test_a_strict_context_that_cannot_run_the_call_writes_nothing():
    cache = cache_mid_run()
    q, k, v = new_tokens(torch.Generator().manual_seed(1))
    before = snapshot(cache)
    with attn_backend("cuda"), pytest.raises(RuntimeError, match="from an attn_backend"):
        attention(q, k, v, kv_cache=cache, layer_id=1, fwd="prefill", is_causal=True)
    assert_unchanged(before, cache)


def test_an_fp8_cache_without_scales_is_refused_before_anything_is_written():
    cache = cache_mid_run(torch.float8_e4m3fn, CacheWithoutScales)
    q, k, v = new_tokens(torch.Generator().manual_seed(1), torch.bfloat16)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="^k_scale, v_scale: an FP8 KV cache"):
        attention(q, k, v, kv_cache=cache, layer_id=1, fwd="prefill", is_causal=True)
    assert_unchanged(before, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "e4m3"])
def test_control_an_accepted_call_changes_the_snapshot(dtype):
    """The comparison catches a write: the same call, valid, writes its k/v into layer 1."""
    cache = cache_mid_run(dtype)
    q_dtype = torch.bfloat16 if dtype != torch.float32 else dtype
    q, k, v = new_tokens(torch.Generator().manual_seed(1), q_dtype)
    before = snapshot(cache)
    attention(q, k, v, kv_cache=cache, layer_id=1, fwd="prefill", is_causal=True)
    with pytest.raises(AssertionError):
        assert_unchanged(before, cache)
    if dtype == torch.float32:
        slots = cache.step.slot_mapping.long()
        assert torch.equal(cache.k_pools[1].view(-1, KV_HEADS, HEAD_DIM)[slots], k[0])


@pytest.mark.parametrize("missing", ["k", "v"])
def test_a_paged_call_with_only_one_of_k_and_v_raises_naming_the_other(missing):
    """``attention(q, None, v, kv_cache=c)`` used to ignore v (and ``(q, k, None)`` raised an
    AttributeError): both or neither are appended."""
    cache = PagedKVCache(1, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    cache.begin_step([0], [3])
    q = torch.randn(1, 3, 4, 8)
    kv = {"k": torch.randn(1, 3, 2, 8), "v": torch.randn(1, 3, 2, 8)}
    kv[missing] = None
    pools = [p.clone() for p in cache.layer(0)]
    with pytest.raises(TypeError, match=f"^{missing}: expected a tensor, got None while"):
        attention(q, kv["k"], kv["v"], kv_cache=cache, fwd="prefill", is_causal=True)
    for before, after in zip(pools, cache.layer(0)):
        assert torch.equal(before, after)
