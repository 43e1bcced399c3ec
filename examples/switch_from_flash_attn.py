"""Code written for flash-attn, run by astrai: the same three functions, the same argument names
and meanings (bottom-right causal masks, ``cache_seqlens`` counted before the append, k/v
appended in place, ``window_size=(left, right)``), checked here against a float64 reference.

    python examples/switch_from_flash_attn.py

Only the import changes:
    from flash_attn import flash_attn_func, flash_attn_with_kvcache        # before
    from astrai.compat.flash_attn import flash_attn_func, flash_attn_with_kvcache   # after
"""

import torch

from astrai.compat.flash_attn import flash_attn_func, flash_attn_with_kvcache

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
torch.manual_seed(0)
batch, heads, kv_heads, head_dim = 2, 8, 2, 64


def reference(q, k, v, causal):
    """flash-attn's definition: query i sees keys j <= i + Lk - Lq under causal."""
    q_len, k_len = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=2)
    v = v.double().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) / head_dim**0.5
    if causal:
        keys = torch.arange(k_len, device=q.device)
        rows = torch.arange(q_len, device=q.device)[:, None] + k_len - q_len
        scores = scores.masked_fill(keys > rows, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


# A chunk of 16 queries over 40 keys: causal is anchored bottom-right, as in flash-attn.
q = torch.randn(batch, 16, heads, head_dim, device=device, dtype=dtype)
k = torch.randn(batch, 40, kv_heads, head_dim, device=device, dtype=dtype)
v = torch.randn(batch, 40, kv_heads, head_dim, device=device, dtype=dtype)
out = flash_attn_func(q, k, v, causal=True)
error = (out.double() - reference(q, k, v, causal=True)).abs().max().item()
print(f"flash_attn_func, causal, 16 queries over 40 keys: max error {error:.1e}")
assert error < tolerance

# Incremental decoding over a preallocated cache: cache_seqlens are the tokens before this call.
k_cache = torch.zeros(batch, 128, kv_heads, head_dim, device=device, dtype=dtype)
v_cache = torch.zeros_like(k_cache)
cached = torch.tensor([30, 7], dtype=torch.int32, device=device)
for b, n in enumerate(cached.tolist()):
    k_cache[b, :n] = torch.randn(n, kv_heads, head_dim, device=device, dtype=dtype)
    v_cache[b, :n] = torch.randn(n, kv_heads, head_dim, device=device, dtype=dtype)
for step in range(4):
    q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
    k_new = torch.randn(batch, 1, kv_heads, head_dim, device=device, dtype=dtype)
    v_new = torch.randn(batch, 1, kv_heads, head_dim, device=device, dtype=dtype)
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
    for b, n in enumerate(cached.tolist()):  # the new token was written at position n
        assert torch.equal(k_cache[b, n], k_new[b, 0])
        want = reference(
            q[b : b + 1], k_cache[b : b + 1, : n + 1], v_cache[b : b + 1, : n + 1], True
        )
        error = (out[b : b + 1].double() - want).abs().max().item()
        assert error < tolerance, (step, b, error)
    cached += 1
print(f"flash_attn_with_kvcache: 4 decode steps, lengths {cached.tolist()}, lse {tuple(lse.shape)}")
