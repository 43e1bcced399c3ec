"""Where a decode call's time goes, astrai's cuda backend against SDPA cuDNN (GPU diagnostic).

    python3 lab/decode_fixed_cost.py [--batch 16] [--lengths 512,2048,8192]

For each length, times four ways of making the call with benchmarks/harness.py's timer (L2 emptied
by a read before each run, CUDA events, medians): through the resolver (torch.ops.astr.attention),
the cuda backend's op directly (torch.ops.astr.cuda_paged_attention), SDPA cuDNN on the
equivalent contiguous cache, and each of them replayed from a CUDA graph (no host work in the
timed span). Next to each, the device time of its kernels from the torch profiler. Event time
minus kernel time is what the launch costs; the kernel time against the bytes read at two lengths
splits a kernel into a fixed cost and a streaming rate. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402


def kernel_us(fn, timer: harness.Timer, runs: int = 10) -> dict:
    """Median device time per kernel name over `runs` calls (each after an L2 flush)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(runs):
            timer.evict(i)
            fn()
        torch.cuda.synchronize()
    flush_names = ("reduce", "Reduce", "Memset")
    times: dict = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if any(word in event.name for word in flush_names):
            continue
        times.setdefault(event.name, []).append(event.device_time)
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measure_length(batch: int, length: int, timer: harness.Timer) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = 32, 8, 128
    torch.manual_seed(0)
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, hkv, length, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    k_tokens = k.transpose(1, 2).reshape(batch * length, hkv, d)
    v_tokens = v.transpose(1, 2).reshape(batch * length, hkv, d)
    cache = harness.build_paged_cache(k_tokens, v_tokens, [length] * batch, 16)
    cache["query_start_loc"] = harness.query_start_loc([1] * batch, "cuda")
    q_sdpa = q.view(batch, hq, 1, d)
    op_args = (
        q,
        cache["k_cache"],
        cache["v_cache"],
        cache["block_table"],
        cache["seq_lens"],
        cache["query_start_loc"],
        1,
        True,
        None,
        False,
        1 / math.sqrt(d),
    )

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=True)

    calls = {
        "astr.attention": lambda: torch.ops.astr.attention(
            q, backend="cuda", max_query_len=1, mode="decode", **cache
        ),
        "astr.cuda_paged_attention": lambda: torch.ops.astr.cuda_paged_attention(*op_args),
        "SDPA cuDNN": cudnn,
    }
    for name in list(calls):
        calls[name + ", graph"] = graphed(calls[name])
    nbytes = harness.decode_bytes(batch, length, hq, hkv, d)
    for name, fn in calls.items():
        ms = timer.measure(fn)["ms"]
        kernels = kernel_us(fn, timer)
        described = "; ".join(f"{n[:48]}: {t:.1f}" for n, t in kernels.items())
        print(
            f"| {batch} | {length} | {name} | {ms * 1e3:.1f} | "
            f"{nbytes / (ms * 1e-3) / 1e12:.2f} | {described} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lengths", default="512,2048,8192")
    args = parser.parse_args()
    import astrai.extension  # noqa: F401  (loads the library)

    timer = harness.Timer(warmup=5, repeats=40)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"`python3 lab/decode_fixed_cost.py --batch {args.batch} --lengths {args.lengths}`\n")
    print("| B | L | call | event us | TB/s | kernels (device us) |")
    print("|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        measure_length(args.batch, length, timer)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
