"""Decode diagnostics for the cuda backend (a measurement run on the GPU, not part of the bench).

    python3 benchmarks/decode_kernel_times.py [--layouts NHD,HND] [--orders shuffled,inorder]
                                              [--shapes 1x32768,16x4096]

For each shape (bf16, Hq=32, Hkv=8, D=128, page 16) and each pool layout / page order:
  - NHD: pool [P, S, Hkv, D] (a slot holds every head); HND: pool [P, Hkv, S, D] (a page holds
    each head's rows together), passed to the op as its [P, S, Hkv, D] transposed view;
  - shuffled: pages handed out in a random order; inorder: consecutive pages;
the time of one decode call with bench_attention.py's timer (L2 flushed before every run, CUDA
events, median), its TB/s, the error against torch_native, and for the first layout the device
time of each kernel (torch profiler, median of 10 flushed calls). Then SDPA cuDNN on a contiguous
[B, Hkv, L, D] cache for scale (this call passes q as [B, Hq, 1, D] with enable_gqa, unlike
bench_attention.py, and varied by +-20% between runs at B=1: use bench_attention.py for the
comparison)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as bench  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def paged_inputs(k, v, batch, length, layout, order):
    pages = batch * length // PAGE
    perm = (
        torch.randperm(pages, device="cuda")
        if order == "shuffled"
        else torch.arange(pages, device="cuda")
    )
    caches = []
    for tokens in (k, v):
        if layout == "NHD":
            view = torch.empty(pages, PAGE, HKV, D, dtype=tokens.dtype, device="cuda")
        else:
            view = torch.empty(pages, HKV, PAGE, D, dtype=tokens.dtype, device="cuda").transpose(
                1, 2
            )
        view[perm.view(batch, -1)] = tokens.view(batch, -1, PAGE, HKV, D)
        caches.append(view)
    return dict(
        k_cache=caches[0],
        v_cache=caches[1],
        block_table=perm.view(batch, -1).to(torch.int32),
        seq_lens=torch.full((batch,), length, dtype=torch.int32, device="cuda"),
        query_start_loc=bench.query_start_loc([1] * batch, "cuda"),
        max_query_len=1,
        mode="decode",
    )


def kernel_times(call, timer) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            timer.evict(i)
            call()
        torch.cuda.synchronize()
    times = {}
    for event in prof.events():
        if event.device_type.name == "CUDA" and "paged" in event.name:
            name = event.name.split("<")[0].split("::")[-1]
            times.setdefault(name, []).append(event.device_time)
    return ", ".join(f"{n} {sorted(t)[len(t) // 2]:.1f} us" for n, t in times.items())


def sdpa_cudnn_us(q, k, v, timer) -> float:
    batch, length = q.shape[0], k.shape[0] // q.shape[0]
    kc = k.view(batch, length, HKV, D).transpose(1, 2).contiguous()
    vc = v.view(batch, length, HKV, D).transpose(1, 2).contiguous()
    qs = q.view(batch, HQ, 1, D)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return timer.measure(sdpa)["ms"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="NHD,HND")
    parser.add_argument("--orders", default="shuffled,inorder")
    parser.add_argument("--shapes", default="1x32768,16x2048,16x4096,64x4096")
    args = parser.parse_args()
    import astrai.extension  # noqa: F401  (loads the library)

    torch.manual_seed(0)
    timer = bench.Timer(warmup=3, repeats=20)
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        nbytes = bench.decode_bytes(batch, length, HQ, HKV, D)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch * length, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        first = True
        for layout in args.layouts.split(","):
            for order in args.orders.split(","):
                kw = paged_inputs(k, v, batch, length, layout, order)
                out = torch.ops.astr.attention(q, backend="cuda", **kw).float()
                ref = torch.ops.astr.attention(q, backend="torch_native", **kw).float()
                err = float((out - ref).norm() / ref.norm())

                def call(q=q, kw=kw):
                    return torch.ops.astr.attention(q, backend="cuda", **kw)

                ms = timer.measure(call)["ms"]
                line = (
                    f"B={batch} L={length} {layout} {order}: {ms * 1e3:.1f} us "
                    f"{nbytes / (ms * 1e-3) / 1e12:.2f} TB/s, rel L2 vs torch_native {err:.1e}"
                )
                if first:
                    line += " | " + kernel_times(call, timer)
                    first = False
                print(line, flush=True)
                del kw
        print(
            f"B={batch} L={length} SDPA cuDNN, contiguous: {sdpa_cudnn_us(q, k, v, timer):.1f} us"
        )
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
