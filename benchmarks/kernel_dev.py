"""Dev timing of the cuda backend's paged kernels against SDPA, for device runs.

    python3 benchmarks/kernel_dev.py [--out DIR]
    python3 benchmarks/kernel_dev.py --standalone DIR   # dev: build only the cuda backend

--standalone builds csrc/kernels + the two cuda bindings with the two schemas into DIR/astr_cuda.so
and writes a shim package DIR/astrai/extension that loads it, so the kernels can be tested
(PYTHONPATH=DIR) while the rest of the package is broken or being written.

Decode: bf16, Hq=32, Hkv=8, D=128; effective bytes = K + V + q read + out written, over the copy
ceiling measured in the same process. Prefill: causal, FLOPs = 2 * B * Hq * S * S * D.
Times: CUDA events, warm-up, median of repeats; decode pools are larger than L2 (60 MB).
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMAS = """
#include <torch/library.h>
TORCH_LIBRARY(astr, m) {
  m.def("append_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("cuda_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, int max_query_len, bool decode, "
        "Tensor? attn_mask, bool is_causal, float scale) -> Tensor");
}
"""


def build_standalone(directory):
    import glob

    from torch.utils.cpp_extension import load

    os.makedirs(os.path.join(directory, "build"), exist_ok=True)
    schema_file = os.path.join(directory, "schemas.cpp")
    with open(schema_file, "w") as f:
        f.write(SCHEMAS)
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "kernels", "*.cu")))
    sources += [
        os.path.join(ROOT, "csrc", "backends", n)
        for n in ("cuda_paged_attention.cu", "append_kv_cuda.cu")
    ]
    load(
        name="astr_cuda",
        sources=[schema_file] + sources,
        is_python_module=False,
        build_directory=os.path.join(directory, "build"),
        extra_cuda_cflags=["-O3", "--use_fast_math", "--expt-relaxed-constexpr", "-lineinfo"],
        verbose=False,
    )
    shim = os.path.join(directory, "astrai", "extension")
    os.makedirs(shim, exist_ok=True)
    open(os.path.join(directory, "astrai", "__init__.py"), "w").close()
    with open(os.path.join(shim, "__init__.py"), "w") as f:
        library = os.path.join(directory, "build", "astr_cuda.so")
        f.write(f"import torch\ntorch.ops.load_library({library!r})\n")
    print("standalone library built in", directory)


def median_ms(fn, warmup=5, repeats=40):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, calls=10, repeats=20):
    """Per-call GPU time from replays of a graph of `calls` back-to-back calls: no host launch
    overhead in the number (decode kernels run for tens of microseconds)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, warmup=3, repeats=repeats) / calls


def check_errors():
    """Bad arguments must raise RuntimeError (run in its own process: a crash shows here)."""
    import astrai.extension  # noqa: F401

    kc = torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(2, dtype=torch.int32, device="cuda")
    try:
        torch.ops.astr.append_kv(k, k, kc, kc.clone(), slots)
        print("append_kv: no error raised")
    except RuntimeError as error:
        print("append_kv raised:", str(error).splitlines()[0])
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.float32)
    sl = torch.tensor([5, 9], dtype=torch.int32, device="cuda")
    bt = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    try:
        torch.ops.astr.cuda_paged_attention(q, kc, kc, bt, sl, sl, 1, True, None, True, 0.1)
        print("cuda_paged_attention: no error raised")
    except RuntimeError as error:
        print("cuda_paged_attention raised:", str(error).splitlines()[0])


def copy_ceiling_tbs():
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeats=10)
    return 2 * src.numel() / ms / 1e9


def paged_inputs(batch, length, page, hq, hkv, d, dtype, q_len=1):
    pages_per_seq = -(-length // page)
    num_pages = batch * pages_per_seq
    k_cache = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_pages, device="cuda").int().view(batch, pages_per_seq)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
    return q, k_cache, v_cache, block_table, seq_lens, qsl


def bench_decode(batch, length, page, ceiling, hq=32, hkv=8, d=128, dtype=torch.bfloat16):
    q, kc, vc, bt, sl, qsl = paged_inputs(batch, length, page, hq, hkv, d, dtype)
    scale = 1 / math.sqrt(d)

    def call():
        return torch.ops.astr.cuda_paged_attention(
            q, kc, vc, bt, sl, qsl, 1, True, None, True, scale
        )

    eager = median_ms(call)  # includes the host-side launch cost
    ours = graph_ms(call)
    nbytes = 2 * batch * length * hkv * d * 2 + 2 * q.numel() * 2
    k = torch.randn(batch, hkv, length, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    qd = q.view(batch, hq, 1, d)
    sdpa = graph_ms(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))
    tbs = nbytes / ours / 1e9
    return dict(
        kind="decode",
        B=batch,
        L=length,
        page=page,
        ours_ms=ours,
        sdpa_ms=sdpa,
        eager_ms=eager,
        ours_TBs=tbs,
        pct_copy=100 * tbs / ceiling,
        sdpa_TBs=nbytes / sdpa / 1e9,
    )


def bench_prefill(batch, length, page=16, hq=32, hkv=8, d=128, dtype=torch.bfloat16):
    q, kc, vc, bt, sl, qsl = paged_inputs(batch, length, page, hq, hkv, d, dtype, q_len=length)
    scale = 1 / math.sqrt(d)
    ours = median_ms(
        lambda: torch.ops.astr.cuda_paged_attention(
            q, kc, vc, bt, sl, qsl, length, False, None, True, scale
        ),
        warmup=3,
        repeats=10,
    )
    flops = 2 * batch * hq * length * length * d
    qs = torch.randn(batch, hq, length, d, device="cuda", dtype=dtype)
    ks = torch.randn_like(qs)
    vs = torch.randn_like(qs)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sdpa = median_ms(
            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), warmup=3, repeats=10
        )
    return dict(
        kind="prefill",
        B=batch,
        L=length,
        page=page,
        ours_ms=ours,
        sdpa_ms=sdpa,
        ours_TFLOPs=flops / ours / 1e9,
        sdpa_TFLOPs=flops / sdpa / 1e9,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--standalone", default=None)
    parser.add_argument("--check-errors", action="store_true")
    args = parser.parse_args()
    if args.check_errors:
        check_errors()
        return
    if args.standalone:
        build_standalone(args.standalone)
        return
    import astrai.extension  # noqa: F401

    torch.manual_seed(0)
    ceiling = copy_ceiling_tbs()
    rows = []
    for page in (16, 1):
        for batch, length in ((16, 4096), (64, 4096), (1, 32768)):
            rows.append(bench_decode(batch, length, page, ceiling))
            torch.cuda.empty_cache()
    for batch, length in ((2, 4096), (1, 8192)):
        rows.append(bench_prefill(batch, length))
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "kernel_dev.json"), "w") as f:
        json.dump(dict(copy_ceiling_TBs=ceiling, rows=rows), f, indent=1)
    print(f"command: python3 benchmarks/kernel_dev.py   copy ceiling {ceiling:.2f} TB/s")
    print(f"{'kind':8} {'B':>3} {'L':>6} {'page':>4} {'ours ms':>9} {'sdpa ms':>9}  result")
    for r in rows:
        if r["kind"] == "decode":
            res = (
                f"{r['ours_TBs']:.2f} TB/s ({r['pct_copy']:.0f}% of copy), "
                f"sdpa(dense) {r['sdpa_TBs']:.2f} TB/s, eager {r['eager_ms']:.3f} ms"
            )
        else:
            res = f"{r['ours_TFLOPs']:.0f} TFLOP/s, sdpa flash {r['sdpa_TFLOPs']:.0f} TFLOP/s"
        print(
            f"{r['kind']:8} {r['B']:>3} {r['L']:>6} {r['page']:>4} {r['ours_ms']:>9.3f} "
            f"{r['sdpa_ms']:>9.3f}  {res}"
        )


if __name__ == "__main__":
    main()
