"""Training through astrai: a causal self-attention layer learns to copy, and its gradients are
checked against a float64 reference.

    python examples/dense_training.py

``attention(q, k, v, is_causal=True)`` takes BLHD tensors ([batch, seq_len, heads, head_dim]) and
is differentiable; GQA when k/v have fewer heads. The resolver picks flash where it is installed,
else torch_native (SDPA); the cuda kernels serve KV-cache calls only.
"""

import torch

import astrai

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
batch, seq_len, heads, kv_heads, head_dim = 2, 64, 8, 2, 32


def reference(q, k, v):
    """Causal attention in float64, written out: the check for astrai's gradients."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / head_dim**0.5
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


# 1. Gradients against the reference, on fresh random inputs.
q = torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
k = torch.randn(batch, seq_len, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
v = torch.randn(batch, seq_len, kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
grad_out = torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype)
out = astrai.attention(q, k, v, is_causal=True)
grads = torch.autograd.grad(out, (q, k, v), grad_out)
exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
exact_grads = torch.autograd.grad(reference(*exact), exact, grad_out.double())
tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
for name, got, want in zip("qkv", grads, exact_grads):
    error = (got.double() - want).abs().max().item()
    print(f"grad {name}: max |astrai - float64| = {error:.2e}")
    assert error < tolerance * want.abs().max().item(), name
print(astrai.explain(q, k, v, is_causal=True))

# 2. A few steps of training: a layer whose only job is to pass its input on.
projection = torch.nn.Linear(head_dim, 3 * head_dim).to(device=device, dtype=dtype)
optimizer = torch.optim.Adam(projection.parameters(), lr=1e-2)
x = torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype)
losses = []
for _ in range(30):
    q, k, v = projection(x).chunk(3, dim=-1)
    loss = (astrai.attention(q, k, v, is_causal=True) - x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"training loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0]
