"""The score and mask variants every backend implements, each checked against its definition
written out in float64: a sliding window (Mistral, Gemma), a logit softcap (Gemma 2) and
attention sinks (gpt-oss).

    python examples/variants.py

- ``window_left=W`` (with ``is_causal``): a query at position p sees keys p - W .. p;
- ``softcap=c``: each score s = scale * q.k becomes c * tanh(s / c);
- ``sinks``: one float32 logit per query head, added to the softmax denominator only.
"""

import math

import torch

import astrai

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
torch.manual_seed(0)
batch, seq_len, heads, head_dim = 2, 48, 4, 32
q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype) for _ in "qkv")


def reference(window_left=-1, softcap=None, sinks=None):
    """Causal attention from the definitions, in float64."""
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, dim]
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(head_dim)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query = torch.arange(seq_len, device=device)[:, None]
    key = torch.arange(seq_len, device=device)[None, :]
    visible = key <= query
    if window_left >= 0:
        visible &= key >= query - window_left
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # a logit with no value: it only enlarges the denominator
        sink = sinks.double().view(1, heads, 1, 1).expand(batch, heads, seq_len, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    return (weights @ vd).transpose(1, 2)


sinks = torch.randn(heads, device=device, dtype=torch.float32)
cases = {
    "sliding window, W = 7": (dict(window_left=7), dict(window_left=7)),
    "softcap 5.0": (dict(softcap=5.0), dict(softcap=5.0)),
    "sinks": (dict(sinks=sinks), dict(sinks=sinks)),
    "all three": (
        dict(window_left=7, softcap=5.0, sinks=sinks),
        dict(window_left=7, softcap=5.0, sinks=sinks),
    ),
}
plain = reference()
for label, (arguments, definition) in cases.items():
    out = astrai.attention(q, k, v, is_causal=True, **arguments)
    want = reference(**definition)
    error = (out.double() - want).abs().max().item()
    moved = (want - plain).abs().max().item()  # the variant changes the answer: it is applied
    print(f"{label:<24} max |astrai - float64| = {error:.1e} (the variant moves it by {moved:.2f})")
    assert error < tolerance and moved > 10 * tolerance, label
