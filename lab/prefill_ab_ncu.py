"""Probe: the same causal paged prefill (B=1, S=4096, Hq=32, Hkv=8, D=128 and D=64, page 16,
shuffled pool) through this build (torch.ops.astr) and a baseline build (torch.ops.astr_old,
loaded from argv[1]), for ncu to compare instruction counts and issue activity:

    ncu --kernel-name regex:prefill --metrics <...> python3 lab/prefill_ab_ncu.py OLD.so
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401

torch.ops.load_library(sys.argv[1])
for head_dim, hq, hkv in ((128, 32, 8), (64, 16, 4)):
    k = torch.randn(4096, hkv, head_dim, dtype=torch.bfloat16, device="cuda")
    cache = harness.build_paged_cache(k, torch.randn_like(k), [4096], 16)
    q = torch.randn(4096, hq, head_dim, dtype=torch.bfloat16, device="cuda")
    args = dict(
        cache,
        query_start_loc=harness.query_start_loc([4096], "cuda"),
        max_query_len=4096,
        mode="prefill",
        is_causal=True,
        backend="cuda",
    )
    for namespace in ("astr", "astr_old"):
        out = getattr(torch.ops, namespace).attention(q, **args)
    torch.cuda.synchronize()
    print(f"D={head_dim}: ran both")
