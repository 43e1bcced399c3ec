"""FlashInfer's ``merge_state`` over astrai's ``merge_states``.

FlashInfer's kernels return, and its merge functions take, the log-sum-exp of each row in base 2
(``log2(sum(2 ** s))`` over scores s pre-multiplied by log2(e)); astrai's ``attention(...,
return_lse=True)`` and ``merge_states`` use the natural log. This module converts at the edges:
code written for FlashInfer passes its base-2 LSE and gets base 2 back.

    from astrai.compat.flashinfer import merge_state
    v, s = merge_state(v_a, s_a, v_b, s_b)   # s_*: float32 [seq_len, num_heads], base 2
"""

from __future__ import annotations

import math

import torch

__all__ = ["merge_state"]

_LN_2 = math.log(2.0)  # natural log of x = log2(x) * ln(2)


def merge_state(v_a, s_a, v_b, s_b):
    """Merges two partial attentions over disjoint key sets, as FlashInfer's ``merge_state``:
    ``v_*`` ``[seq_len, num_heads, head_dim]``, ``s_*`` float32 ``[seq_len, num_heads]``, the
    base-2 log-sum-exp. Returns ``(v, s)``: the attention over both key sets and its base-2
    log-sum-exp. A side that saw no key (``s = -inf``) weighs exactly 0."""
    for name, s in (("s_a", s_a), ("s_b", s_b)):
        if s.dtype != torch.float32:
            raise ValueError(f"{name}: expected a float32 base-2 log-sum-exp, got {s.dtype}")
    v, s = torch.ops.astr.merge_states(v_a, s_a * _LN_2, v_b, s_b * _LN_2)
    return v, s / _LN_2
