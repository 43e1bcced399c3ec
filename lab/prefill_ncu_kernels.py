"""Probe for Nsight Compute: one causal paged prefill (B=1, S=4096, Hq=32, Hkv=8, D=128, page 16)
through each D = 128 prefill kernel of the loaded build (the warp-specialised one, then the first
wgmma kernel), three calls each: `--launch-skip 2 --launch-count 3` profiles the third call of the
first and the first two of the second.

    ncu --kernel-name regex:paged_prefill ... python3 lab/prefill_ncu_kernels.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401

k = torch.randn(4096, 8, 128, dtype=torch.bfloat16, device="cuda")
cache = harness.build_paged_cache(k, torch.randn_like(k), [4096], 16)
q = torch.randn(4096, 32, 128, dtype=torch.bfloat16, device="cuda")
args = dict(
    cache,
    query_start_loc=harness.query_start_loc([4096], "cuda"),
    max_query_len=4096,
    mode="prefill",
    is_causal=True,
    backend="cuda",
)
for tuning in ("prefill_kernel=warp_specialized", "prefill_kernel=wgmma"):
    torch.ops.astr.set_kernel_tuning(tuning)
    for _ in range(3):
        torch.ops.astr.attention(q, **args)
    torch.cuda.synchronize()
    print(tuning, "ran", flush=True)
