"""Split KV: attend over two halves of the keys separately, then merge the halves exactly with
their log-sum-exps (what context parallelism and cascade attention do).

    python examples/merge_states.py

``attention(..., return_lse=True)`` returns ``(out, lse)``, lse float32 in the natural log, out's
shape without its last dim. ``merge_states(out_a, lse_a, out_b, lse_b)`` combines two partial
results over disjoint keys into the attention over their union.
"""

import torch

import astrai

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
q = torch.randn(2, 16, 8, 64, device=device, dtype=dtype)  # [batch, q_len, heads, head_dim]
k = torch.randn(2, 300, 8, 64, device=device, dtype=dtype)
v = torch.randn(2, 300, 8, 64, device=device, dtype=dtype)

whole, whole_lse = astrai.attention(q, k, v, return_lse=True)
out_a, lse_a = astrai.attention(q, k[:, :120], v[:, :120], return_lse=True)
out_b, lse_b = astrai.attention(q, k[:, 120:], v[:, 120:], return_lse=True)
merged, merged_lse = astrai.merge_states(out_a, lse_a, out_b, lse_b)

tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
out_error = (merged.float() - whole.float()).abs().max().item()
lse_error = (merged_lse - whole_lse).abs().max().item()
print(
    f"merged halves vs one call: max |out error| {out_error:.1e}, max |lse error| {lse_error:.1e}"
)
assert out_error < tolerance and lse_error < tolerance

# The same op on the raw tensors: torch.ops.astr.merge_states(out_a, lse_a, out_b, lse_b).
raw, _ = torch.ops.astr.merge_states(out_a, lse_a, out_b, lse_b)
assert torch.equal(raw, merged)
