"""Probe for Nsight Compute: one causal paged prefill (B=1, S=8192, Hq=32, Hkv=8, D=128, page 16,
shuffled pool, the pool bench_attention's peers read) through astrai's cuda backend and through
FlashInfer's fa3 backend, each warmed up first. Only the two measured calls run between
cudaProfilerStart and cudaProfilerStop, so

    ncu --profile-from-start off --set full python3 lab/prefill_ncu_vs_fa3.py

profiles exactly one call of each (issue 32: what makes the square rows slower than fa3).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import peers  # noqa: E402

import astrai.extension  # noqa: E402,F401

seq, hq, hkv, head_dim = 8192, 32, 8, 128
problem = peers.AttentionProblem(
    "prefill",
    torch.randn(seq, hq, head_dim, dtype=torch.bfloat16, device="cuda"),
    [seq],
    [seq],
    True,
    k_tokens=torch.randn(seq, hkv, head_dim, dtype=torch.bfloat16, device="cuda"),
    v_tokens=torch.randn(seq, hkv, head_dim, dtype=torch.bfloat16, device="cuda"),
)
calls = {
    "astrai": peers.astrai_attention("cuda", 16)(problem),
    "fa3": peers.flashinfer_prefill("fa3")(problem),
}
outs = {name: call() for name, call in calls.items()}
for _ in range(3):
    for call in calls.values():
        call()
torch.cuda.synchronize()
diff = (outs["astrai"].float() - outs["fa3"].float()).norm() / outs["fa3"].float().norm()
print(f"astrai vs fa3: rel L2 {diff.item():.2e}", flush=True)
torch.cuda.cudart().cudaProfilerStart()
for call in calls.values():
    call()
    torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("profiled one call of each:", ", ".join(calls), flush=True)
