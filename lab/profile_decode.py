"""Decode calls for Nsight Compute: each shape's kernels run twice (the second is the one to
read), over a bf16 pool, then with --fp8 the same values in an e4m3 pool (per-head scales), then
with --baseline LIB the bf16 call through torch.ops.astr_old of that library (an A/B of builds).
Run as `ncu --clock-control none --kernel-name regex:paged ... python3 THIS [--fp8]
[--baseline LIB] [--shapes B:L,...]`."""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fp8  # noqa: E402
import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401

parser = argparse.ArgumentParser()
parser.add_argument("--fp8", action="store_true")
parser.add_argument("--baseline")
parser.add_argument("--shapes", default="16:4096,64:4096,1:32768")
args = parser.parse_args()
if args.baseline:
    torch.ops.load_library(args.baseline)
shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]

for batch, length in shapes:
    torch.manual_seed(0)
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch * length, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = harness.build_paged_cache(k, torch.randn_like(k), [length] * batch, 16)
    cache["query_start_loc"] = harness.query_start_loc([1] * batch, "cuda")
    calls = [(torch.ops.astr, cache)]
    if args.fp8:
        calls.append((torch.ops.astr, bench_fp8.fp8_copy(cache)))
    if args.baseline:
        calls.append((torch.ops.astr_old, cache))
    for ops, pool in calls:
        for _ in range(2):
            ops.attention(q, backend="cuda", max_query_len=1, mode="decode", **pool)
        torch.cuda.synchronize()
    print(f"B={batch} L={length} done", flush=True)
