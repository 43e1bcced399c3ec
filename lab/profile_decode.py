"""Decode calls for Nsight Compute: each shape's kernels run twice (the second is the one to
read), over a bf16 pool, or with --fp8 the same values in an e4m3 pool (per-head scales) right
after. Run as `ncu --clock-control none --kernel-name regex:paged ... python3 THIS [--fp8]`."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fp8  # noqa: E402
import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401

SHAPES = [(16, 4096), (64, 4096), (1, 32768)]
WITH_FP8 = "--fp8" in sys.argv

for batch, length in SHAPES:
    torch.manual_seed(0)
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch * length, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = harness.build_paged_cache(k, torch.randn_like(k), [length] * batch, 16)
    cache["query_start_loc"] = harness.query_start_loc([1] * batch, "cuda")
    for pool in [cache, bench_fp8.fp8_copy(cache)] if WITH_FP8 else [cache]:
        for _ in range(2):
            torch.ops.astr.attention(q, backend="cuda", max_query_len=1, mode="decode", **pool)
        torch.cuda.synchronize()
    print(f"B={batch} L={length} done", flush=True)
