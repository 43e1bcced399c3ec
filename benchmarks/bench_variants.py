"""What the attention variants cost on the cuda backend (H200): one process, interleaved timing
(benchmarks/harness.py: CUDA events, L2 emptied before each run, medians).

  - window: decode at L = 32768 with window_left = 4095 against a full decode at L = 4096, same B
    (target: at most 1.15x); the windowed call reads only the window's tiles.
  - softcap, sinks, return_lse: each against the same call without it, decode (B=16, L=8192 and
    B=64, L=4096) and causal prefill (B=1, S=8192; a ragged batch with cached prefixes)
    (targets: softcap and sinks at most 1.05x on decode and 1.10x on prefill; lse at most 1.03x);
  - head dim 96 against 128 (decode and prefill), and its prefill against SDPA cuDNN.

    python3 benchmarks/bench_variants.py [--out DIR] [--repeats N]

Writes variants_<GPU>_<date>.json and .md with the command, GPU, torch and CUDA versions.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401  (loads the library)

HQ, HKV, D = 32, 8, 128
TARGETS = {"window": 1.15, "softcap": (1.05, 1.10), "sinks": (1.05, 1.10), "lse": 1.03}


def variant_arguments(sink_logits, window_left=-1, softcap=None, sinks=False, lse=False):
    """astr::attention's keyword arguments for the variants a case turns on."""
    extra = {}
    if window_left >= 0:
        extra["window_left"] = window_left
    if softcap:
        extra["softcap"] = softcap
    if sinks:
        extra["sinks"] = sink_logits
    if lse:
        extra["return_lse"] = True
    return extra


def decode_call(batch: int, length: int, head_dim: int = D):
    q, args = harness.uniform_decode_call(batch, length, HQ, HKV, head_dim)
    args = dict(args, is_causal=True, backend="cuda")
    sinks = torch.randn(HQ, device="cuda")

    def make(**variants):
        extra = variant_arguments(sinks, **variants)
        return lambda: torch.ops.astr.attention(q, **args, **extra)

    return make


def prefill_call(prefixes, chunks, head_dim: int = D):
    device = "cuda"
    lengths = [p + c for p, c in zip(prefixes, chunks)]
    k = torch.randn(sum(lengths), HKV, head_dim, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    cache = harness.build_paged_cache(k, v, lengths, 16)
    q = torch.randn(sum(chunks), HQ, head_dim, dtype=torch.bfloat16, device=device)
    args = dict(
        cache,
        query_start_loc=harness.query_start_loc(chunks, device),
        max_query_len=max(chunks),
        mode="prefill",
        is_causal=True,
        backend="cuda",
    )
    sinks = torch.randn(HQ, device=device)

    def make(**variants):
        extra = variant_arguments(sinks, **variants)
        return lambda: torch.ops.astr.attention(q, **args, **extra)

    return make


def main() -> int:
    parser = harness.timing_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    timer = harness.Timer(args.warmup, args.repeats)
    rows = []

    def compare(case, base_fn, variant_fns):
        names = ["base", *variant_fns]
        times = timer.measure_interleaved([base_fn, *variant_fns.values()])
        base = times[0]["ms"] * 1e3
        for name, t in zip(names[1:], times[1:]):
            us = t["ms"] * 1e3
            rows.append(dict(case=case, variant=name, base_us=base, us=us, ratio=us / base))
            print(f"{case:<34} {name:<8} {base:8.1f} us -> {us:8.1f} us  {us / base:.3f}x")

    for batch in (16, 64):
        # The window: L = 32768 with a 4096-position window against L = 4096.
        full = decode_call(batch, 4096)()
        windowed = decode_call(batch, 32768)(window_left=4095)
        compare(f"decode B={batch} L=4096 vs 32768 window", full, {"window": windowed})
        harness.free_cached()
    for batch, length in ((16, 8192), (64, 4096)):
        make = decode_call(batch, length)
        compare(
            f"decode B={batch} L={length}",
            make(),
            {"softcap": make(softcap=30.0), "sinks": make(sinks=True), "lse": make(lse=True)},
        )
        harness.free_cached()
    mix = harness.ragged_mix(0, 8, (0, 4096), (256, 2048))
    for case, (prefixes, chunks) in (
        ("prefill B=1 S=8192", ([0], [8192])),
        ("prefill ragged 8, cached prefixes", mix),
    ):
        make = prefill_call(prefixes, chunks)
        compare(
            case,
            make(),
            {"softcap": make(softcap=30.0), "sinks": make(sinks=True), "lse": make(lse=True)},
        )
        harness.free_cached()

    # Head dim 96 (Phi-3): the same calls at D=96 against D=128 (0.75x the bytes and FLOPs),
    # and the prefill against SDPA cuDNN at D=96 (contiguous, kv heads repeated).
    decode96 = decode_call(16, 8192, head_dim=96)()
    compare("decode B=16 L=8192 D=128 vs D=96", decode_call(16, 8192)(), {"hdim96": decode96})
    prefill96 = prefill_call([0], [8192], head_dim=96)()
    compare("prefill B=1 S=8192 D=128 vs D=96", prefill_call([0], [8192])(), {"hdim96": prefill96})
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

        q, k = (torch.randn(1, HQ, 8192, 96, dtype=torch.bfloat16, device="cuda") for _ in "qk")
        v = torch.randn_like(k)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        cudnn()
        compare("prefill B=1 S=8192 D=96, SDPA cuDNN vs cuda", cudnn, {"cuda": prefill96})
    except RuntimeError as error:
        print(f"SDPA cuDNN at D=96 did not run: {str(error).splitlines()[0]}")
    harness.free_cached()

    env = harness.run_environment(args.repeats)
    lines = [
        f"# Attention variants on the cuda backend: {env['gpu']}, {env['date']}",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, CUDA {env['cuda']}; bf16, Hq={HQ}, "
        f"Hkv={HKV}, D={D}, page 16, shuffled pool; medians of {args.repeats}, L2 emptied "
        "before each run, the variant and its base interleaved in one loop.",
        "",
        "| case | variant | base us | with variant us | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['base_us']:.1f} | {r['us']:.1f} | "
            f"{r['ratio']:.3f} |"
        )
    harness.write_record(args.out, "variants", env, dict(rows=rows, targets=TARGETS), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
