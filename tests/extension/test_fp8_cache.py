"""FP8 KV caches on the CPU (torch_native, the reference): what is stored, what is read, and what
is refused.

Stored: fp8(clamp(x / scale[kv head], -max, max)), torch's rounding; read: stored.float() * scale.
The attention reference (tests/reference.py) is float64 over the dequantized stored bytes, the
values every backend reads; a control shows the comparison fails when the scales are ignored.
"""

from __future__ import annotations

import pytest
import torch

import astrai.extension as ae
from astrai.extension import PagedKVCache, ops
from tests.reference import paged_reference, quantize

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
def test_append_stores_the_quantized_values_torch_would(dtype):
    cache = PagedKVCache(1, 8, 16, 2, 32, dtype=dtype)
    cache.set_scales(0, torch.tensor([0.5, 2.0]), torch.tensor([0.25, 3.0]))
    k = torch.randn(1, 20, 2, 32, dtype=torch.bfloat16) * 4
    v = torch.randn(1, 20, 2, 32, dtype=torch.bfloat16) * 4
    k[0, 3, 0, :4] = torch.tensor([1e6, -1e6, 5000.0, -70000.0])  # beyond the format's range
    cache.begin_step([7], [20])
    cache.append(0, k, v)
    slots = cache.step.slot_mapping.long()
    k_scale, v_scale = cache.scales(0)
    stored_k = cache.k_pools[0].view(-1, 2, 32)[slots]
    stored_v = cache.v_pools[0].view(-1, 2, 32)[slots]
    expected_k = quantize(k[0], k_scale, dtype)
    assert torch.equal(stored_k.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(stored_v.view(torch.uint8), quantize(v[0], v_scale, dtype).view(torch.uint8))
    # Saturation at the format's largest finite value, never NaN or inf.
    largest = torch.finfo(dtype).max
    assert stored_k[3, 0, 0].float() == largest and stored_k[3, 0, 1].float() == -largest
    assert torch.isfinite(stored_k.float()).all()


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_attention_reads_stored_values_times_scale(dtype, page_size, q_dtype):
    """A prefill with a cached prefix, then two decode steps, GQA 4, per-head scales."""
    torch.manual_seed(page_size)
    hq, hkv, d = 8, 2, 32
    cache = PagedKVCache(1, 64, page_size, hkv, d, dtype=dtype)
    first_k = torch.randn(1, 37, hkv, d, dtype=q_dtype) * 3
    first_v = torch.randn(1, 37, hkv, d, dtype=q_dtype)
    cache.scales_from(0, first_k, first_v)
    cache.begin_step([0], [37])
    ae.attention(
        torch.randn(1, 37, hq, d, dtype=q_dtype),
        first_k,
        first_v,
        kv_cache=cache,
        fwd="prefill",
        is_causal=True,
    )
    for new in (5, 1, 1):
        step = cache.begin_step([0], [new])
        q = torch.randn(1, new, hq, d, dtype=q_dtype)
        k = torch.randn(1, new, hkv, d, dtype=q_dtype)
        v = torch.randn(1, new, hkv, d, dtype=q_dtype)
        fwd = "decode" if new == 1 else "prefill"
        out = ae.attention(q, k, v, kv_cache=cache, fwd=fwd, is_causal=True)
        assert out.dtype == q_dtype
        k_pool, v_pool = cache.layer(0)
        k_scale, v_scale = cache.scales(0)
        paged = (q[0], k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc)
        ref = paged_reference(*paged, is_causal=True, k_scale=k_scale, v_scale=v_scale)
        err = (out[0].double() - ref).norm() / ref.norm()
        assert err < 1e-2, err
    # Control: reading the stored values without their scales is far off.
    unscaled = paged_reference(*paged, is_causal=True)
    assert (out[0].double() - unscaled).norm() / unscaled.norm() > 0.1


def test_fp8_cache_error_against_a_bf16_cache_on_random_data():
    """The end-to-end error of an e4m3 cache (scales from data) against the same steps over a
    bf16 cache: a few percent, as e4m3's 3-bit mantissa gives."""
    torch.manual_seed(3)
    hq, hkv, d = 8, 2, 64
    errors = {}
    outs = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        torch.manual_seed(3)
        cache = PagedKVCache(1, 64, 16, hkv, d, dtype=dtype)
        k = torch.randn(1, 300, hkv, d, dtype=torch.bfloat16)
        v = torch.randn(1, 300, hkv, d, dtype=torch.bfloat16)
        q = torch.randn(1, 300, hq, d, dtype=torch.bfloat16)
        if cache.is_fp8:
            cache.scales_from(0, k, v)
        cache.begin_step([0], [300])
        outs[dtype] = ae.attention(q, k, v, kv_cache=cache, fwd="prefill", is_causal=True)
    for dtype in FP8:
        diff = (outs[dtype].double() - outs[torch.bfloat16].double()).norm()
        errors[dtype] = (diff / outs[torch.bfloat16].double().norm()).item()
    print(f"relative L2 error against a bf16 cache: {errors}")
    assert errors[torch.float8_e4m3fn] < 0.06 and errors[torch.float8_e5m2] < 0.12
    assert errors[torch.float8_e4m3fn] > 1e-3  # a control: the FP8 cache did quantize


def test_scales_from_maps_each_heads_amax_onto_the_formats_largest_value():
    cache = PagedKVCache(2, 8, 16, 3, 16, dtype=torch.float8_e4m3fn)
    k = torch.zeros(1, 10, 3, 16)
    k[0, 4, 0, 2] = -896.0
    k[0, 1, 1, 0] = 44.8
    v = torch.ones(1, 10, 3, 16)
    cache.scales_from(1, k, v)
    k_scale, v_scale = cache.scales(1)
    assert torch.allclose(k_scale, torch.tensor([2.0, 0.1, 1.0]))  # an all-zero head keeps 1
    assert torch.allclose(v_scale, torch.full((3,), 1 / 448))
    assert torch.equal(cache.k_scales[0], torch.ones(3))  # other layers untouched


def test_scales_are_refused_when_wrong():
    cache = PagedKVCache(1, 8, 16, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale: expected a float or"):
        cache.set_scales(0, torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="positive finite"):
        cache.set_scales(0, 0.0, 1.0)
    with pytest.raises(ValueError, match="positive finite"):
        cache.set_scales(0, float("nan"), 1.0)
    bf16 = PagedKVCache(1, 8, 16, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        bf16.set_scales(0, 1.0, 1.0)


def fp8_call_args(scales=True, q_dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn):
    cache = PagedKVCache(1, 8, 16, 2, 16, dtype=cache_dtype)
    cache.begin_step([0], [4])
    k_pool, v_pool = cache.layer(0)
    q = torch.randn(4, 4, 16, dtype=q_dtype)
    args = dict(
        k_cache=k_pool,
        v_cache=v_pool,
        block_table=cache.step.block_table,
        seq_lens=cache.step.seq_lens,
        query_start_loc=cache.step.query_start_loc,
        max_query_len=4,
        mode="prefill",
        is_causal=True,
    )
    if scales:
        args.update(k_scale=cache.k_scales[0], v_scale=cache.v_scales[0])
    return q, args


def test_an_fp8_pool_without_scales_is_refused():
    q, args = fp8_call_args(scales=False)
    with pytest.raises(ValueError, match="k_scale, v_scale: an FP8 KV cache"):
        torch.ops.astr.attention(q, **args)


def test_scales_of_the_wrong_shape_or_dtype_are_refused():
    q, args = fp8_call_args()
    with pytest.raises(
        ValueError, match=r"k_scale: expected a float32 tensor of shape \[kv_heads\]"
    ):
        torch.ops.astr.attention(q, **dict(args, k_scale=torch.ones(3)))
    with pytest.raises(ValueError, match="v_scale: expected a float32"):
        torch.ops.astr.attention(q, **dict(args, v_scale=torch.ones(2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="k_scale, v_scale: an FP8 KV cache"):
        torch.ops.astr.attention(q, **dict(args, v_scale=None))


def test_an_fp8_q_is_refused():
    q, args = fp8_call_args()
    with pytest.raises(ValueError, match="q: an FP8 q is not supported"):
        torch.ops.astr.attention(q.to(torch.float8_e4m3fn), **args)


def test_scales_with_a_16_bit_cache_are_refused():
    q, args = fp8_call_args(scales=False, cache_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k_scale/v_scale: only for an FP8 KV cache"):
        torch.ops.astr.attention(
            q, **args, k_scale=torch.ones(2), v_scale=torch.ones(2), backend="torch_native"
        )


def test_append_into_an_fp8_pool_needs_scales_and_a_float_dtype():
    pool = torch.zeros(4, 16, 2, 16, dtype=torch.float8_e4m3fn)
    k = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    before = pool.view(torch.uint8).clone()
    with pytest.raises(RuntimeError, match="k_scale, v_scale: an FP8 pool"):
        ops.append_kv(k, k, pool, pool.clone(), slots)
    with pytest.raises(RuntimeError, match="k: an FP8 pool takes new tokens"):
        ops.append_kv(
            k.to(torch.int32),
            k.to(torch.int32),
            pool,
            pool.clone(),
            slots,
            torch.ones(2),
            torch.ones(2),
        )
    with pytest.raises(RuntimeError, match="k_scale, v_scale: only for FP8 pools"):
        ops.append_kv(
            k,
            k,
            torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16),
            torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16),
            slots,
            torch.ones(2),
            torch.ones(2),
        )
    assert torch.equal(pool.view(torch.uint8), before)  # a refused append wrote nothing


def test_flash_refuses_an_fp8_cache_with_the_reason():
    q, args = fp8_call_args()
    decision = ae.explain(
        q.view(1, 4, 4, 16), kv_cache=_cache_of(args), fwd="prefill", is_causal=True
    )
    assert any("FP8 KV cache" in r for r in decision.rejected["flash"])
    assert decision.backend == "torch_native"


def _cache_of(args):
    class Adapter:
        step = type("Step", (), {})()

        def layer(self, layer_id):
            return args["k_cache"], args["v_cache"]

        def scales(self, layer_id):
            return args["k_scale"], args["v_scale"]

    adapter = Adapter()
    for name in ("block_table", "seq_lens", "query_start_loc", "max_query_len"):
        setattr(adapter.step, name, args[name])
    return adapter


def test_demo_reports_tokens_per_memory_for_each_cache_dtype():
    from astrai.extension.kv_cache import tokens_that_fit

    bf16 = tokens_that_fit(
        1 << 30, num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16
    )
    fp8 = tokens_that_fit(
        1 << 30, num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn
    )
    assert fp8 == 2 * bf16 and bf16 == (1 << 30) // (32 * 8 * 128 * 2 * 2)
