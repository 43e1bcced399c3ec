"""The float64 reference of latent attention (``astr::mla_attention``), written from its
definition (csrc/README.md, "The ops"), never by calling a backend:

    score(t, j) = scale * (q_nope[t] . ckv[j] + q_rope[t] . krope[j])
    out[t]      = sum_j softmax_j(score(t, j)) * ckv[j]

over the positions j that token t sees: multi-query attention of q = [q_nope | q_rope] over one
kv head whose keys are [ckv | krope] and whose values are ckv, with the paged calls' causal rule
(tests/reference.py: ``sequence_reference``). An FP8 latent reads as ``stored.float() *
ckv_scale``; ``append_mla`` stores ``fp8(clamp(x / ckv_scale, -448, 448))``.
"""

from __future__ import annotations

import torch

from tests.reference import gather_tokens, sequence_reference


def dequantize_latent(stored, ckv_scale):
    """What an FP8 latent holds, as read: stored [..., Dc] (e4m3), ckv_scale float32 [1]."""
    return stored.float() * ckv_scale.to(stored.device).float()


def quantize_latent(x, ckv_scale):
    """What append_mla stores of latents x [..., Dc] in an e4m3 pool."""
    largest = torch.finfo(torch.float8_e4m3fn).max
    scaled = x.float() / ckv_scale.to(x.device).float()
    return scaled.clamp(-largest, largest).to(torch.float8_e4m3fn)


def mla_reference(
    q_nope,
    q_rope,
    ckv_cache,
    krope_cache,
    block_table,
    seq_lens,
    query_start_loc,
    *,
    scale: float,
    is_causal: bool = True,
    ckv_scale=None,
    return_lse: bool = False,
):
    """q_nope [T, H, Dc] and q_rope [T, H, Dr] pack each sequence's new tokens (query_start_loc
    [B + 1]; None for a decode: one each); ckv_cache [P, S, Dc] (e4m3 with ckv_scale [1]),
    krope_cache [P, S, Dr]; block_table [B, W]; seq_lens [B]. -> out [T, H, Dc] (and lse [T, H]),
    float64 on q's device. A decode slot of length 0 gives zeros (lse -inf)."""
    lengths = torch.as_tensor(seq_lens).tolist()
    if query_start_loc is None:
        starts = list(range(len(lengths) + 1))
    else:
        starts = torch.as_tensor(query_start_loc).tolist()
    page_size = ckv_cache.shape[1]
    q = torch.cat([q_nope.double(), q_rope.double()], dim=-1)
    outs, lses = [], []
    for b, length in enumerate(lengths):
        rows = slice(starts[b], starts[b + 1])
        pages = block_table[b, : -(-length // page_size)]
        latents = gather_tokens(ckv_cache.unsqueeze(2), pages, length)  # [L, 1, Dc]
        if ckv_scale is not None:
            latents = dequantize_latent(latents, ckv_scale)
        ropes = gather_tokens(krope_cache.unsqueeze(2), pages, length)  # [L, 1, Dr]
        keys = torch.cat([latents.double(), ropes.double()], dim=-1).to(q.device)
        out, lse = sequence_reference(
            q[rows],
            keys,
            latents.double().to(q.device),
            is_causal=is_causal,
            scale=scale,
            return_lse=True,
        )
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out
