"""Probe: the FP8 decode (e4m3, per-head scales, bf16 q, D=128, Hq=32, Hkv=8, page 16, shuffled
pool) in every decode form and split count that ASTR_KERNEL_TUNING can force, against the plan's
own choice, interleaved with L2 emptied before each run (benchmarks/harness.py).

    python3 lab/fp8_decode_forms.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fp8  # noqa: E402
import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401

TUNINGS = [
    "",
    "decode_form=split,decode_splits=1",
    "decode_form=split,decode_splits=2",
    "decode_form=split,decode_splits=3",
    "decode_form=split,decode_splits=4",
    "decode_form=split,decode_splits=6",
    "decode_form=split,decode_splits=8",
    "decode_form=split,decode_splits=12",
    "decode_form=split,decode_splits=24",
    "decode_form=split,decode_splits=48",
    "decode_form=cluster",
    "decode_form=block_pairs",
    "decode_form=eight_warps",
    "decode_form=eight_warps,decode_splits=2",
]
SHAPES = [(16, 4096), (16, 8192), (1, 32768), (64, 4096), (128, 2048)]
timer = harness.Timer(5, 30)


def under(tuning, fn):
    def run():
        torch.ops.astr.set_kernel_tuning(tuning)
        try:
            return fn()
        finally:
            torch.ops.astr.set_kernel_tuning("")

    return run


for batch, length in SHAPES:
    torch.manual_seed(0)
    q, args = harness.uniform_decode_call(batch, length, 32, 8, 128)
    fp8 = bench_fp8.fp8_copy(args)
    call = lambda fp8=fp8, q=q: torch.ops.astr.attention(q, backend="cuda", **fp8)  # noqa: E731
    times = [t["ms"] * 1e3 for t in timer.measure_interleaved([under(t, call) for t in TUNINGS])]
    print(f"B={batch} L={length}: plan {times[0]:.1f} us", flush=True)
    for tuning, us in zip(TUNINGS[1:], times[1:]):
        print(f"    {tuning:<42} {us:7.1f} us  {us / times[0]:.3f}x")
    harness.free_cached()
