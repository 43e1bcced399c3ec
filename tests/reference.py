"""The float64 reference every numerics test compares with, written from the op's definitions
(csrc/README.md, "The ops"; kernels/paged_attention/params.h), never by calling a backend.

For one query row and the keys it may see:

    s_j = scale * q . k_j               scale defaults to 1 / sqrt(D)
    s_j = c * tanh(s_j / c)             with a softcap c
    s_j = s_j + bias_j                  with an additive mask (-inf removes key j)
    lse = log(sum_j exp(s_j) + exp(sink))   the sink (one logit per q head, no value) if given
    out = sum_j exp(s_j - lse) * v_j

A row that sees no key gives out = 0 and lse = -inf, or its sink. GQA: q head h reads kv head
h // (Hq / Hkv). Which keys a row sees:

- dense (BLHD): a bool mask (True = attend) or an additive one, broadcast to [B, Hq, Lq, Lk];
  `is_causal` aligns top-left as SDPA does (query i sees keys j <= i);
- paged: new token i of a sequence of length L with n new tokens sits at position L - n + i;
  `is_causal` lets it see positions <= L - n + i; a mask [T, K] covers kv positions 0..K-1 and
  removes the rest;
- `window_left` W >= 0 (with `is_causal`): a query at position p sees keys p - W .. p;
- `topk_indices` (int32, one row of key positions per query, shared by all heads): a query sees
  only the keys its row lists (-1 lists nothing; a position listed twice counts once), of those
  the rest of the rules allow. Dense rows list positions along k's length; paged rows list
  positions within the query's sequence.
- paged, `tree_mask` [T, >= max_query_len] (bool, with `is_causal`): new token i of a sequence of
  length L with n new tokens sees positions < L - n (its cached prefix) and new token j (position
  L - n + j) where its row's column j is true, in place of the causal edge; the window still
  applies.

An FP8 cache reads as `stored.float() * scale` (one float32 scale per kv head) and stores
`fp8(clamp(x / scale, -max, max))`.

Values that no row of a sequence sees never reach the output, even NaN (tests hide NaN there to
show a kernel never read them).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def attend(
    q,
    k,
    v,
    visible=None,
    scale: Optional[float] = None,
    bias=None,
    *,
    softcap: Optional[float] = None,
    sinks=None,
    return_lse: bool = False,
):
    """Attention of one sequence: q [n, Hq, D], k [m, Hkv, D], v [m, Hkv, Dv]; visible (bool) and
    bias (additive) broadcast to [Hq, n, m]. -> out float64 [n, Hq, Dv] (and lse [n, Hq])."""
    q, k, v = q.double(), k.double(), v.double()
    (n, q_heads, _), kv_heads = q.shape, k.shape[1]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # q head h reads kv head h // group. Grouped, not k and v copied per q head: a latent of 12000
    # positions read by 128 heads would take 7 GB in float64.
    grouped_q = q.view(n, kv_heads, group, q.shape[-1])
    scores = torch.einsum("ikgd,jkd->kgij", grouped_q, k).reshape(q_heads, n, k.shape[0]) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.device, torch.float64)
    if visible is not None:
        scores = scores.masked_fill(~visible.to(scores.device), -math.inf)
    logits = scores
    if sinks is not None:
        sink = sinks.to(scores.device, torch.float64).view(q_heads, 1, 1)
        logits = torch.cat([scores, sink.expand(q_heads, scores.shape[1], 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, n]; -inf where a row sees nothing
    weights = torch.exp(scores - lse[..., None]).masked_fill(torch.isneginf(lse)[..., None], 0.0)
    unseen = (scores == -math.inf).all(dim=1).all(dim=0)  # keys no row sees: [m]
    v = v.masked_fill(unseen.view(-1, 1, 1), 0.0)
    grouped_weights = weights.view(kv_heads, group, n, k.shape[0])
    out = torch.einsum("kgij,jkd->ikgd", grouped_weights, v).reshape(n, q_heads, v.shape[-1])
    return (out, lse.transpose(0, 1)) if return_lse else out


def listed_keys(rows, length: int, device=None):
    """Which of `length` keys each row of top-k indices lists: rows [n, topk] -> bool [n, length].
    Entries are -1 (nothing) or positions 0 .. length - 1 (anything else is not a valid call)."""
    rows = torch.as_tensor(rows).tolist()
    listed = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, row in enumerate(rows):
        for position in set(row) - {-1}:
            if not 0 <= position < length:
                raise ValueError(f"row {i} lists {position}, outside 0 .. {length - 1}")
            listed[i, position] = True
    return listed.to(device)


def dense_reference(
    q,
    k,
    v,
    *,
    attn_mask=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_left: int = -1,
    softcap: Optional[float] = None,
    sinks=None,
    return_lse: bool = False,
    topk_indices=None,
):
    """The dense call: q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D]; topk_indices [B, Lq, topk]. -> out
    [B, Lq, Hq, Dv] (and lse [B, Lq, Hq]), float64."""
    batch, q_len, q_heads, _ = q.shape
    kv_len = k.shape[1]
    queries = torch.arange(q_len, device=q.device)[:, None]
    keys = torch.arange(kv_len, device=q.device)[None, :]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
    if is_causal:
        visible &= keys <= queries
    if window_left >= 0:
        visible &= keys >= queries - window_left
    masks = bias = None
    if attn_mask is not None:
        masks = attn_mask.to(q.device).expand(batch, q_heads, q_len, kv_len)
    outs, lses = [], []
    for b in range(batch):
        seen = visible
        if masks is not None and masks.dtype == torch.bool:
            seen = visible & masks[b]
        elif masks is not None:
            bias = masks[b]
        if topk_indices is not None:
            seen = seen & listed_keys(topk_indices[b], kv_len, q.device)
        out, lse = attend(
            q[b], k[b], v[b], seen, scale, bias, softcap=softcap, sinks=sinks, return_lse=True
        )
        outs.append(out)
        lses.append(lse)
    out, lse = torch.stack(outs), torch.stack(lses)
    return (out, lse) if return_lse else out


def sequence_reference(
    q,
    k,
    v,
    *,
    is_causal: bool,
    scale: Optional[float] = None,
    attn_mask=None,
    window_left: int = -1,
    softcap: Optional[float] = None,
    sinks=None,
    return_lse: bool = False,
    topk_indices=None,
    tree_mask=None,
):
    """One sequence of a paged call: q [n, Hq, D] its new tokens, k/v [L, Hkv, D] all its tokens
    (cached and new); attn_mask [n, K] its rows of the call's mask; topk_indices [n, topk] its
    rows (positions 0 .. L - 1); tree_mask [n, >= n] its rows of the call's tree mask. -> out
    [n, Hq, Dv] (and lse [n, Hq]), float64."""
    new, length = q.shape[0], k.shape[0]
    device = q.device
    positions = torch.arange(length - new, length, device=device)[:, None]
    keys = torch.arange(length, device=device)[None, :]
    visible = torch.ones(new, length, dtype=torch.bool, device=device)
    if tree_mask is not None:
        named = torch.zeros(new, length, dtype=torch.bool, device=device)
        named[:, : length - new] = True  # the cached prefix
        named[:, length - new :] = tree_mask[:, :new].to(device)
        visible &= named
    elif is_causal:
        visible &= keys <= positions
    if window_left >= 0:
        visible &= keys >= positions - window_left
    bias = None
    if attn_mask is not None:
        columns = min(attn_mask.shape[1], length)
        inside = attn_mask[:, :columns].to(device)
        if attn_mask.dtype == torch.bool:
            covered = torch.zeros(new, length, dtype=torch.bool, device=device)
            covered[:, :columns] = inside
            visible &= covered
        else:
            bias = torch.full((new, length), -math.inf, dtype=torch.float64, device=device)
            bias[:, :columns] = inside.double()
    if topk_indices is not None:
        visible &= listed_keys(topk_indices, length, device)
    return attend(
        q, k, v, visible, scale, bias, softcap=softcap, sinks=sinks, return_lse=return_lse
    )


def gather_tokens(pool, pages, length: int):
    """Tokens 0..length-1 of a sequence whose block-table row is `pages`: token t is slot
    t % S of page pages[t // S]. pool [P, S, H, D] -> [length, H, D]."""
    page_size = pool.shape[1]
    positions = torch.arange(length, device=pool.device)
    pages = torch.as_tensor(pages, device=pool.device).long()
    return pool[pages[positions // page_size], positions % page_size]


def dequantize(stored, scale):
    """What an FP8 cache holds, as read: stored [..., Hkv, D], scale float32 [Hkv] (None: the
    bytes as they are)."""
    if scale is None:
        return stored.float()
    return stored.float() * scale.to(stored.device).view(-1, 1)


def quantize(x, scale, fp8_dtype):
    """What append_kv stores in an FP8 cache: x [..., Hkv, D], scale float32 [Hkv]."""
    largest = torch.finfo(fp8_dtype).max
    scaled = x.float() / scale.to(x.device).view(-1, 1)
    return scaled.clamp(-largest, largest).to(fp8_dtype)


def paged_reference(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start_loc,
    *,
    is_causal: bool,
    scale: Optional[float] = None,
    attn_mask=None,
    window_left: int = -1,
    softcap: Optional[float] = None,
    sinks=None,
    k_scale=None,
    v_scale=None,
    return_lse: bool = False,
    topk_indices=None,
    tree_mask=None,
):
    """The paged call: q [T, Hq, D] packs each sequence's new tokens (query_start_loc [B+1], None
    for a decode: one each); k_cache/v_cache [P, S, Hkv, D] (FP8 with k_scale/v_scale [Hkv]);
    block_table [B, W]; seq_lens [B]; attn_mask [T, K]; topk_indices [T, topk]; tree_mask
    [T, >= max new tokens]. -> out
    [T, Hq, Dv] (and lse [T, Hq]), float64 on q's device."""
    lengths = torch.as_tensor(seq_lens).tolist()
    if query_start_loc is None:
        starts = list(range(len(lengths) + 1))
    else:
        starts = torch.as_tensor(query_start_loc).tolist()
    fp8 = k_cache.element_size() == 1
    outs, lses = [], []
    for b, length in enumerate(lengths):
        rows = slice(starts[b], starts[b + 1])
        pages = block_table[b, : -(-length // k_cache.shape[1])]
        k = gather_tokens(k_cache, pages, length)
        v = gather_tokens(v_cache, pages, length)
        if fp8:
            k, v = dequantize(k, k_scale), dequantize(v, v_scale)
        out, lse = sequence_reference(
            q[rows],
            k.to(q.device),
            v.to(q.device),
            is_causal=is_causal,
            scale=scale,
            attn_mask=None if attn_mask is None else attn_mask[rows],
            window_left=window_left,
            softcap=softcap,
            sinks=sinks,
            return_lse=True,
            topk_indices=None if topk_indices is None else topk_indices[rows],
            tree_mask=None if tree_mask is None else tree_mask[rows],
        )
        outs.append(out)
        lses.append(lse)
    if outs:
        out, lse = torch.cat(outs), torch.cat(lses)
    else:
        out = torch.zeros(0, q.shape[1], v_cache.shape[-1], dtype=torch.float64, device=q.device)
        lse = torch.zeros(0, q.shape[1], dtype=torch.float64, device=q.device)
    return (out, lse) if return_lse else out


def assert_close_to_reference(out, ref, dtype=None):
    """Tolerances fit for the output's dtype (float32 here; bf16/fp16 looser)."""
    dtype = dtype or out.dtype
    tolerance = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}.get(dtype, 5e-3)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output holds NaN or inf"
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)


def tree_of_drafts(parents):
    """The tree mask of one sequence's drafts [n, n] (bool): parents[i] is the draft that draft i
    follows (-1: the cached prefix's last token), each parent before its child; draft i sees
    itself and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        assert parent < i, "a draft follows an earlier draft"
        mask[i, i] = True
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def random_tree_parents(n, generator=None):
    """Parents of a random tree of n drafts (tree_of_drafts): draft i follows one of the drafts
    before it, or the prefix."""
    return [int(torch.randint(-1, i, (), generator=generator)) if i > 0 else -1 for i in range(n)]


def pack_tree_masks(trees, width):
    """The call's tree mask [T, width] from each sequence's [n, n] tree, rows in q's order."""
    rows = []
    for tree in trees:
        padded = torch.zeros(tree.shape[0], width, dtype=torch.bool)
        padded[:, : tree.shape[1]] = tree
        rows.append(padded)
    return torch.cat(rows)
