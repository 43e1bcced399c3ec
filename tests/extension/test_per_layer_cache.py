"""PagedKVCache with per-layer shapes: each layer its own kv heads and q/k and v head dims (Gemma
4: head dim 512 on its global layers and 256 on its sliding ones; DeepSeek's MHA form: q/k 192 and
v 128), one page allocator and one step's metadata for all. Expectations are the float64
reference (tests/reference.py)."""

from __future__ import annotations

import pytest
import torch

import astrai.extension as ae
from astrai.extension import PagedKVCache, ops
from astrai.extension.kv_cache import tokens_that_fit
from tests.reference import assert_close_to_reference, sequence_reference

# config.h's rows as the library reports them ("192/128": q/k 192, v 128).
CUDA_HEAD_DIMS = ", ".join(
    str(d) if d == dv else f"{d}/{dv}"
    for d, dv in ops.BUILD_INFO["paged_kernels"]["head_dim_pairs"]
)


def test_each_layer_gets_pools_of_its_own_shape():
    cache = PagedKVCache(
        3, 8, 4, [2, 1, 2], [16, 32, 24], dtype=torch.float32, head_dim_v=[16, 32, 8]
    )
    shapes = [(k.shape, v.shape) for k, v in (cache.layer(i) for i in range(3))]
    assert shapes == [
        ((8, 4, 2, 16), (8, 4, 2, 16)),
        ((8, 4, 1, 32), (8, 4, 1, 32)),
        ((8, 4, 2, 24), (8, 4, 2, 8)),
    ]
    assert cache.layer_head_dims == (16, 32, 24) and cache.layer_kv_heads == (2, 1, 2)


def test_a_shape_the_layers_do_not_share_is_not_answered_for_all_of_them():
    cache = PagedKVCache(2, 8, 4, 2, [16, 32], dtype=torch.float32)
    assert cache.num_kv_heads == 2
    with pytest.raises(
        ValueError,
        match=r"head_dim: the layers differ \(\[16, 32\]\); read layer_head_dims\[layer\]",
    ):
        _ = cache.head_dim
    uniform = PagedKVCache(2, 8, 4, 2, 16, dtype=torch.float32)
    assert (uniform.head_dim, uniform.head_dim_v, uniform.num_kv_heads) == (16, 16, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(head_dim=[16]),
            r"head_dim: expected an integer or one per layer \(2\), got 1 values",
        ),
        (dict(head_dim=[16, 0]), r"head_dim\[1\]: expected a positive integer"),
        (
            dict(head_dim=16, head_dim_v=[8, 8, 8]),
            r"head_dim_v: expected an integer or one per layer",
        ),
        (
            dict(head_dim=16, num_kv_heads=[2, -1]),
            r"num_kv_heads\[1\]: expected a positive integer",
        ),
    ],
)
def test_per_layer_shapes_are_checked_naming_the_argument(kwargs, message):
    arguments = dict(num_kv_heads=2, dtype=torch.float32)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PagedKVCache(2, 8, 4, **arguments)


def test_append_checks_each_layers_own_shape():
    cache = PagedKVCache(2, 8, 4, 2, [16, 32], dtype=torch.float32)
    cache.begin_step([0], [3])
    cache.append(1, torch.randn(3, 2, 32), torch.randn(3, 2, 32))
    with pytest.raises(ValueError, match=r"k: expected \[..., kv_heads=2, head_dim=32\]"):
        cache.append(1, torch.randn(3, 2, 16), torch.randn(3, 2, 16))


def test_fp8_scales_follow_each_layers_kv_heads():
    cache = PagedKVCache(2, 8, 4, [2, 4], [16, 32], dtype=torch.float8_e4m3fn)
    assert [s.shape[0] for s in cache.k_scales] == [2, 4]
    cache.set_scales(1, torch.full((4,), 0.5), 2.0)
    with pytest.raises(ValueError, match=r"k_scale: expected a float or \[kv_heads=2\]"):
        cache.set_scales(0, torch.ones(4), 1.0)


def test_tokens_that_fit_sums_the_layers():
    bf16 = tokens_that_fit(1 << 20, 2, [2, 1], [256, 512], torch.bfloat16)
    assert bf16 == (1 << 20) // ((2 * 512 + 1 * 1024) * 2)
    assert tokens_that_fit(1 << 20, 2, 2, 256, torch.bfloat16) == (1 << 20) // (2 * 2 * 512 * 2)


def test_a_gemma4_like_decode_loop_runs_every_layer_through_one_cache():
    """Gemma 4's shapes: layer 0 slides (head dim 256, window 5), layer 1 is global (head dim
    512, one kv head); layer 2 has DeepSeek's MHA form (q/k 192, v 128). A ragged prefill, then
    decode steps, each layer against the float64 reference over every token so far."""
    layers = [
        dict(kv_heads=2, d=256, dv=256, window_left=4),
        dict(kv_heads=1, d=512, dv=512, window_left=-1),
        dict(kv_heads=2, d=192, dv=128, window_left=-1),
    ]
    hq, page = 4, 4
    cache = PagedKVCache(
        len(layers),
        32,
        page,
        [layer["kv_heads"] for layer in layers],
        [layer["d"] for layer in layers],
        dtype=torch.float64,
        head_dim_v=[layer["dv"] for layer in layers],
    )
    g = torch.Generator().manual_seed(0)
    history = {(i, s): ([], []) for i in range(len(layers)) for s in (0, 1)}
    steps = [[7, 3]] + [[1, 1]] * 4
    for step, new in enumerate(steps):
        fwd = "prefill" if step == 0 else "decode"
        cache.begin_step([0, 1], new)
        for i, layer in enumerate(layers):
            shape = (1, sum(new), layer["kv_heads"])
            k = torch.randn(*shape, layer["d"], generator=g, dtype=torch.float64)
            v = torch.randn(*shape, layer["dv"], generator=g, dtype=torch.float64)
            q = torch.randn(1, sum(new), hq, layer["d"], generator=g, dtype=torch.float64)
            out = ae.attention(
                q,
                k,
                v,
                kv_cache=cache,
                layer_id=i,
                fwd=fwd,
                is_causal=True,
                window_left=layer["window_left"],
            )
            assert out.shape == (1, sum(new), hq, layer["dv"])
            start = 0
            for s, n in enumerate(new):
                keys, values = history[(i, s)]
                keys.append(k[0, start : start + n])
                values.append(v[0, start : start + n])
                ref = sequence_reference(
                    q[0, start : start + n],
                    torch.cat(keys),
                    torch.cat(values),
                    is_causal=True,
                    window_left=layer["window_left"],
                )
                assert_close_to_reference(out[0, start : start + n], ref)
                if i == 0 and step == len(steps) - 1:
                    # Control: the sliding layer without its window differs.
                    full = sequence_reference(
                        q[0, start : start + n], torch.cat(keys), torch.cat(values), is_causal=True
                    )
                    assert not torch.allclose(out[0, start : start + n], full, atol=1e-6)
                start += n


def test_cuda_takes_head_dim_512_and_qk_192_with_v_128():
    """Both are rows of the cuda kernels' list (config.h): on a CPU tensor cuda is passed over for
    the device alone, never for the head dims; a pair that is no row is named as a pair."""
    for d, dv in ((512, 512), (192, 128), (192, 96)):
        cache = PagedKVCache(1, 4, 4, 1, d, dtype=torch.bfloat16, head_dim_v=dv)
        cache.begin_step([0], [1])
        q = torch.randn(1, 1, 2, d, dtype=torch.bfloat16)
        decision = ae.explain(q, kv_cache=cache, fwd="decode", is_causal=True)
        head_dim_reasons = [r for r in decision.rejected["cuda"] if "head_dim" in r]
        if dv == 96:
            assert head_dim_reasons == [
                f"unsupported head_dim 192 with v head_dim 96 (supported: {CUDA_HEAD_DIMS})"
            ], decision.rejected["cuda"]
        else:
            assert head_dim_reasons == [], decision.rejected["cuda"]
            assert any("needs CUDA tensors" in r for r in decision.rejected["cuda"])
