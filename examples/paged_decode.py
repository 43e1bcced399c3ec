"""Serving over a paged KV cache: a ragged prefill of three prompts, then a decode loop, each step
checked against a float64 reference; on a GPU the decode step is captured once in a CUDA graph
and replayed with new tokens and growing lengths.

    python examples/paged_decode.py

``PagedKVCache`` holds each layer's pools ``[num_pages, page_size, kv_heads, head_dim]``;
``begin_step(seq_ids, num_new_tokens)`` reserves pages and builds the step's metadata (block
table, lengths, slots) in one host-to-device copy; ``attention(q, k, v, kv_cache=cache,
layer_id=0, fwd=...)`` appends the new tokens' k/v, then q attends over each sequence's cache.
"""

import torch

import astrai

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
torch.manual_seed(0)
heads, kv_heads, head_dim = 8, 2, 64
prompt_lengths = [37, 5, 20]
seq_ids = [0, 1, 2]
decode_steps = 8
width = 4  # pages per sequence in every decode step's block table (fixed for the CUDA graph)

cache = astrai.PagedKVCache(
    1,
    num_pages=32,
    page_size=16,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    dtype=dtype,
    device=device,
)
history = {s: ([], []) for s in seq_ids}  # each sequence's keys and values, for the reference


def reference(q, seq_id):
    """q [q_len, heads, D] attending causally (bottom-right) over the sequence's whole history."""
    keys = torch.cat(history[seq_id][0]).double().repeat_interleave(heads // kv_heads, dim=1)
    values = torch.cat(history[seq_id][1]).double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / head_dim**0.5
    q_len, kv_len = q.shape[0], keys.shape[0]
    visible = torch.arange(kv_len, device=q.device)[None, :] <= (
        torch.arange(q_len, device=q.device)[:, None] + kv_len - q_len
    )
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def new_tokens(counts):
    total = sum(counts)
    q = torch.randn(1, total, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, total, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(1, total, kv_heads, head_dim, device=device, dtype=dtype)
    start = 0
    for seq_id, count in zip(seq_ids, counts):
        history[seq_id][0].append(k[0, start : start + count])
        history[seq_id][1].append(v[0, start : start + count])
        start += count
    return q, k, v


def check(out, q, counts, label):
    start, worst = 0, 0.0
    for seq_id, count in zip(seq_ids, counts):
        want = reference(q[0, start : start + count], seq_id)
        got = out.reshape(-1, heads, head_dim)[start : start + count].double()
        worst = max(worst, (got - want).abs().max().item())
        start += count
    print(f"{label}: max |astrai - float64| = {worst:.1e}")
    assert worst < tolerance, label


# Ragged prefill: the batch's new tokens packed along dim 1, [1, 62, heads, head_dim].
cache.begin_step(seq_ids, prompt_lengths)
q, k, v = new_tokens(prompt_lengths)
out = astrai.attention(q, k, v, kv_cache=cache, layer_id=0, is_causal=True, fwd="prefill")
check(out, q, prompt_lengths, "prefill")
print(astrai.explain(q, k, v, kv_cache=cache, layer_id=0, is_causal=True, fwd="prefill"))


def decode_step(q, k, v):
    # One new token per sequence: q is [batch, 1, heads, head_dim].
    return astrai.attention(
        q.view(3, 1, heads, head_dim),
        k.view(3, 1, kv_heads, head_dim),
        v.view(3, 1, kv_heads, head_dim),
        kv_cache=cache,
        layer_id=0,
        fwd="decode",
    )


ones = [1] * len(seq_ids)
if device == "cuda":
    # One CUDA graph for every decode step: the graph reads fixed buffers (q, k, v and the step's
    # metadata), which each step refills; lengths grow on the device, never read back.
    cache.begin_step(seq_ids, ones, block_table_width=width)
    static_q, static_k, static_v = new_tokens(ones)
    captured = astrai.StepMetadata(
        *(
            t.clone()
            for t in (
                cache.step.block_table,
                cache.step.seq_lens,
                cache.step.query_start_loc,
                cache.step.slot_mapping,
            )
        ),
        1,
        "decode",
    )
    cache.step = captured
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up: rewrites this step's own slots
        decode_step(static_q, static_k, static_v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_out = decode_step(static_q, static_k, static_v)
    graph.replay()
    check(static_out, static_q, ones, "decode step 1 (CUDA graph)")
    for step in range(2, decode_steps + 1):
        captured.copy_(cache.begin_step(seq_ids, ones, block_table_width=width))
        cache.step = captured
        q, k, v = new_tokens(ones)
        static_q.copy_(q)
        static_k.copy_(k)
        static_v.copy_(v)
        graph.replay()
        check(static_out, q, ones, f"decode step {step} (CUDA graph)")
else:
    print("no GPU: the decode steps run eagerly (on a GPU they replay one CUDA graph)")
    for step in range(1, decode_steps + 1):
        cache.begin_step(seq_ids, ones, block_table_width=width)
        q, k, v = new_tokens(ones)
        check(decode_step(q, k, v), q, ones, f"decode step {step}")
print(f"sequence lengths now {[cache.seq_len(s) for s in seq_ids]}")
