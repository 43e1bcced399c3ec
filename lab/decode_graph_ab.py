"""Probe: is a decode row's gap to the baseline build in its kernels or on the host? The same
decode (bf16, Hq=32, Hkv=8, D=128, page 16, shuffled pool) through this build (torch.ops.astr)
and the baseline (torch.ops.astr_old, loaded from argv[1]), each timed eagerly and as a captured
CUDA graph replay (no host work inside the events), interleaved, L2 emptied before each run
(benchmarks/harness.py); also each call's host time (perf_counter around an eager call).

    python3 lab/decode_graph_ab.py OLD.so
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401

torch.ops.load_library(sys.argv[1])
SHAPES = [(1, 32768), (16, 512), (16, 2048), (16, 4096), (128, 2048)]
timer = harness.Timer(5, 40)


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_us(fn, n=200):
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


print("B L | eager new/old us | graph new/old us | host new/old us")
for batch, length in SHAPES:
    torch.manual_seed(0)
    q, args = harness.uniform_decode_call(batch, length, 32, 8, 128)
    new = lambda q=q, args=args: torch.ops.astr.attention(q, backend="cuda", **args)  # noqa: E731
    old = lambda q=q, args=args: torch.ops.astr_old.attention(q, backend="cuda", **args)  # noqa: E731
    fns = [new, old, graphed(new), graphed(old)]
    us = [t["ms"] * 1e3 for t in timer.measure_interleaved(fns)]
    host = [host_us(new), host_us(old)]
    print(
        f"B={batch} L={length} | {us[0]:.1f} / {us[1]:.1f} ({us[0] / us[1]:.3f}) | "
        f"{us[2]:.1f} / {us[3]:.1f} ({us[2] / us[3]:.3f}) | {host[0]:.1f} / {host[1]:.1f}",
        flush=True,
    )
    harness.free_cached()
