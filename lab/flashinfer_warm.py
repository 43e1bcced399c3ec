"""Probe helper: runs FlashInfer's fa3 prefill once at each head dim given (default 64, 256), so
that its modules that are not prebuilt compile (JIT, minutes) before anything is timed.

    python3 lab/flashinfer_warm.py [64,256]
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_attention as bench  # noqa: E402
import peers  # noqa: E402

for d in (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "64,256").split(",")):
    start = time.time()
    problem, ref = bench.prefill_problem(1, 256, 16, 4, d, "cuda")
    out = peers.flashinfer_prefill("fa3")(problem)()
    torch.cuda.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(
        f"flashinfer fa3 D={d}: ready in {time.time() - start:.0f} s, rel L2 {err:.2e}", flush=True
    )
