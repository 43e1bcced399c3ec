"""Decode diagnostics for the cuda backend (a measurement run on the GPU, not part of the bench).

    python3 lab/decode_kernel_times.py [--layouts NHD,HND] [--orders shuffled,inorder]
                                       [--shapes 1x32768,16x4096,32x4096x32]

For each shape (BxL or BxLxHkv; bf16, Hq=32, Hkv=8 unless given, D=128, page 16) and each pool
layout / page order:
  - NHD: pool [P, S, Hkv, D] (a slot holds every head); HND: pool [P, Hkv, S, D] (a page holds
    each head's rows together), passed to the op as its [P, S, Hkv, D] transposed view; KV_NHD:
    one pool [P, 2, S, Hkv, D] (a page's K and V side by side), passed as its two halves;
  - page orders: shuffled (pages handed out in a random order), inorder (each sequence's pages
    consecutive), interleaved (page j of sequence b at j * B + b: what a pool gives sequences
    that grow together a page at a time), window (shuffled inside aligned windows of 64 pages,
    the windows in order), chunks (runs of 64 consecutive pages, the runs in a random order);
the time of one decode call with benchmarks/harness.py's timer (L2 flushed before every run, CUDA
events, median), its TB/s, the error against torch_native, and the device time of each kernel
(torch profiler, median of 10 flushed calls; with --kernel-times first, for the first layout
and order only). Then SDPA cuDNN on a contiguous
[B, Hkv, L, D] cache for scale (this call passes q as [B, Hq, 1, D] with enable_gqa, unlike
benchmarks/bench_attention.py, and varied by +-20% between runs at B=1: use the benchmark for
the comparison)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402

HQ, D, PAGE = 32, 128, 16
WINDOW = 64  # pages: 64 x 16 slots x 8 heads x 128 x 2 bytes = 2 MiB of K at Hkv = 8


def page_order(order: str, batch: int, pages: int) -> torch.Tensor:
    """Pool page of each (sequence, page) in row-major order, as a flat permutation."""
    if order == "shuffled":
        return torch.randperm(pages, device="cuda")
    if order == "inorder":
        return torch.arange(pages, device="cuda")
    if order == "interleaved":
        return torch.arange(pages, device="cuda").view(-1, batch).t().reshape(-1)
    if order in ("window", "chunks"):
        assert pages % WINDOW == 0, f"{pages} pages are not whole windows of {WINDOW}"
        windows = pages // WINDOW
        if order == "window":
            inside = torch.argsort(torch.rand(windows, WINDOW, device="cuda"), dim=1)
            base = torch.arange(windows, device="cuda").unsqueeze(1) * WINDOW
        else:
            inside = torch.arange(WINDOW, device="cuda").expand(windows, WINDOW)
            base = torch.randperm(windows, device="cuda").unsqueeze(1) * WINDOW
        return (base + inside).reshape(-1)
    raise ValueError(f"--orders: unknown page order {order!r}")


def paged_inputs(k, v, batch, length, layout, order):
    pages = batch * length // PAGE
    hkv = k.shape[1]
    perm = page_order(order, batch, pages)
    caches = []
    if layout == "KV_NHD":
        # One pool, a page's K and V side by side ([P, 2, S, Hkv, D], as FlashInfer lays it out).
        pool = torch.empty(pages, 2, PAGE, hkv, D, dtype=k.dtype, device="cuda")
        caches = [pool[:, 0], pool[:, 1]]
    for tokens in (k, v):
        if layout == "KV_NHD":
            view = caches[0 if tokens is k else 1]
            view[perm.view(batch, -1)] = tokens.view(batch, -1, PAGE, hkv, D)
            continue
        if layout == "NHD":
            view = torch.empty(pages, PAGE, hkv, D, dtype=tokens.dtype, device="cuda")
        else:
            view = torch.empty(pages, hkv, PAGE, D, dtype=tokens.dtype, device="cuda").transpose(
                1, 2
            )
        view[perm.view(batch, -1)] = tokens.view(batch, -1, PAGE, hkv, D)
        caches.append(view)
    return dict(
        k_cache=caches[0],
        v_cache=caches[1],
        block_table=perm.view(batch, -1).to(torch.int32),
        seq_lens=torch.full((batch,), length, dtype=torch.int32, device="cuda"),
        query_start_loc=harness.query_start_loc([1] * batch, "cuda"),
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
    batch, length, hkv = q.shape[0], k.shape[0] // q.shape[0], k.shape[1]
    kc = k.view(batch, length, hkv, D).transpose(1, 2).contiguous()
    vc = v.view(batch, length, hkv, D).transpose(1, 2).contiguous()
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
    parser.add_argument(
        "--kernel-times", default="all", choices=("all", "first"), help="which runs get profiled"
    )
    args = parser.parse_args()
    import astrai.extension  # noqa: F401  (loads the library)

    torch.manual_seed(0)
    timer = harness.Timer(warmup=3, repeats=20)
    for shape in args.shapes.split(","):
        batch, length, hkv = ([int(x) for x in shape.split("x")] + [8])[:3]
        nbytes = harness.decode_bytes(batch, length, HQ, hkv, D)
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch * length, hkv, D, dtype=torch.bfloat16, device="cuda")
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
                if first or args.kernel_times == "all":
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
