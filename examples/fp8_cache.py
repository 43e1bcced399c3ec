"""An FP8 KV cache with scales calibrated from the data: pages hold k / scale and v / scale in
e4m3 (one byte), one float32 scale per layer and kv head; every read applies the scale.

    python examples/fp8_cache.py

``PagedKVCache(..., dtype=torch.float8_e4m3fn)`` holds twice the tokens of a bf16 cache in the
same bytes (``tokens_that_fit``). Calibrate the scales once, on the first prefill's k/v, before
appending them: ``scales_from(layer_id, k, v)`` sets amax / 448 per kv head (448: e4m3's largest
value), or ``set_scales(layer_id, k_scale, v_scale)`` sets them from your own statistics.
"""

import torch

import astrai
from astrai import tokens_that_fit

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16  # an FP8 cache serves fp16/bf16 models
torch.manual_seed(0)
heads, kv_heads, head_dim, prompt = 8, 2, 64, 100
layers = 32
for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
    fits = tokens_that_fit(80 << 30, layers, kv_heads, 128, cache_dtype)
    print(f"{str(cache_dtype):<22} tokens in 80 GiB (32 layers, 2 kv heads, D = 128): {fits:,}")

# k and v with very different ranges per kv head: one scale per head keeps each one's precision.
q = torch.randn(1, prompt, heads, head_dim, device=device, dtype=dtype)
k = torch.randn(1, prompt, kv_heads, head_dim, device=device, dtype=dtype)
v = torch.randn(1, prompt, kv_heads, head_dim, device=device, dtype=dtype)
k[..., 1, :] *= 4.0
v[..., 0, :] *= 1e-3

outputs = {}
for cache_dtype in (dtype, torch.float8_e4m3fn):
    cache = astrai.PagedKVCache(
        1,
        num_pages=16,
        page_size=16,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=cache_dtype,
        device=device,
    )
    if cache.is_fp8:
        cache.scales_from(0, k, v)  # amax / 448 per kv head, before the first append
        print(f"calibrated k scales {cache.k_scales[0].tolist()}")
        print(f"calibrated v scales {cache.v_scales[0].tolist()}")
    cache.begin_step([0], [prompt])
    outputs[cache_dtype] = astrai.attention(
        q, k, v, kv_cache=cache, layer_id=0, is_causal=True, fwd="prefill"
    )

exact = outputs[dtype].double()


def worst_head_error(out) -> float:
    """The largest relative error of any query head (the small v head must not drown)."""
    difference = torch.linalg.vector_norm(out.double() - exact, dim=(0, 1, 3))
    return (difference / torch.linalg.vector_norm(exact, dim=(0, 1, 3))).max().item()


relative = worst_head_error(outputs[torch.float8_e4m3fn])
print(
    f"FP8 cache against a {str(dtype).replace('torch.', '')} cache: relative error {relative:.3f}"
)
assert relative < 0.1  # e4m3 keeps 3 mantissa bits: a few percent

# Unscaled, the small v head would lose most of its bits and the large k head would saturate.
unscaled = astrai.PagedKVCache(
    1,
    num_pages=16,
    page_size=16,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    dtype=torch.float8_e4m3fn,
    device=device,
)
unscaled.begin_step([0], [prompt])
out = astrai.attention(q, k, v, kv_cache=unscaled, layer_id=0, is_causal=True, fwd="prefill")
worse = worst_head_error(out)
print(f"the same cache with scales of 1.0: relative error {worse:.3f}")
assert worse > relative
