"""Latent attention (issue 50), one process on one GPU: astrai's mla_attention (cuda backend, bf16
and FP8 latent) beside FlashInfer's BatchMLAPagedAttentionWrapper (its sm90 backend, fa3) over the
same latent pool and pages, and SDPA over the decompressed equivalent (per-head K 192 and V 128,
not causal) as a reference line where that fits in memory; its GB/s column counts the latent
bytes of the same positions, not the heads it reads. Timing: benchmarks/harness.py (CUDA events, L2
emptied before each run, a case's implementations interleaved, medians).

Shapes: H = 128 and H = 16 (a TP-8 shard), page 64, B in {1, 16, 64, 128}, L in {1k, 4k, 16k,
32k}, s_q in {1, 2} (2: multi-token prediction, a causal prefill call of 2 tokens a sequence).
Columns: latent GB/s (latent and rotary-key bytes read, once per sequence, over the time) and its
share of the run's device-to-device copy rate; TFLOP/s (2 * rows * visible positions * (576 +
512)); the time over FlashInfer's. Issue 50's targets: memory-bound rows (H = 16, or B x L
large) at least 90% of the copy rate and 1.1x FlashInfer; compute-bound rows (H = 128, B >= 64)
at least 550 TFLOP/s and 1.1x FlashInfer; the FP8 latent at most 0.6x the bf16 time at
memory-bound rows.

    python3 benchmarks/bench_mla.py [--heads 128,16] [--batches 1,16,64,128]
        [--lengths 1024,4096,16384,32768] [--tokens 1,2] [--out DIR] [--repeats N]

Writes mla_<GPU>_<date>.json and .md (with the command) under --out.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401  (loads the library)

LATENT, ROPE, PAGE = 512, 64, 64
QK_NOPE, V_HEAD = 128, 128  # DeepSeek-V3's decompressed heads: K 128 + 64, V 128
SDPA_BYTES_LIMIT = 24 << 30  # the decompressed K and V of a row past this are not built


def ints(text: str):
    return [int(x) for x in text.split(",")]


def latent_case(heads: int, batch: int, length: int, tokens: int):
    """The pool, metadata and queries of one row: B sequences of L positions (their last
    `tokens` new), pages shuffled."""
    device, dtype = "cuda", torch.bfloat16
    width = math.ceil(length / PAGE)
    pages = torch.randperm(batch * width, device=device).int()
    ckv = torch.randn(batch * width, PAGE, LATENT, dtype=dtype, device=device)
    krope = torch.randn(batch * width, PAGE, ROPE, dtype=dtype, device=device)
    rows = batch * tokens
    return dict(
        q_nope=torch.randn(rows, heads, LATENT, dtype=dtype, device=device),
        q_rope=torch.randn(rows, heads, ROPE, dtype=dtype, device=device),
        ckv_cache=ckv,
        krope_cache=krope,
        block_table=pages.view(batch, width),
        seq_lens=torch.full((batch,), length, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, rows + 1, tokens, dtype=torch.int32, device=device),
        max_query_len=tokens,
        mode="decode" if tokens == 1 else "prefill",
        scale=(QK_NOPE + ROPE) ** -0.5,
    )


def astrai_call(case, fp8: bool):
    """The op's call and the kernel its plan picks ("tensor_core/split x4": csrc/README.md's
    latent kernel table; ASTR_KERNEL_TUNING=mla_kernel=simple times the simple kernel)."""
    args = dict(case, backend="cuda")
    if fp8:
        scale = case["ckv_cache"].float().abs().amax() / 448
        args["ckv_cache"] = (case["ckv_cache"].float() / scale).to(torch.float8_e4m3fn)
        args["ckv_scale"] = scale.reshape(1)
    return (lambda: torch.ops.astr.mla_attention(**args)), torch.ops.astr.cuda_mla_plan(**args)


def flashinfer_call(case):
    """FlashInfer's MLA wrapper planned on the same pool and pages, or (None, why not)."""
    try:
        import flashinfer

        batch, width = case["block_table"].shape
        lengths = case["seq_lens"]
        pages_used = (lengths + PAGE - 1) // PAGE
        kv_indptr = torch.cat([lengths.new_zeros(1), pages_used.cumsum(0)]).int()
        kv_indices = torch.cat([case["block_table"][b, : int(pages_used[b])] for b in range(batch)])
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="fa3")
        wrapper.plan(
            case["query_start_loc"],
            kv_indptr,
            kv_indices,
            lengths,
            case["q_nope"].shape[1],
            LATENT,
            ROPE,
            PAGE,
            case["max_query_len"] > 1,  # causal: a decode's one token sees everything anyway
            case["scale"],
            torch.bfloat16,
            torch.bfloat16,
        )
        args = (case["q_nope"], case["q_rope"], case["ckv_cache"], case["krope_cache"])
        wrapper.run(*args)
        return (lambda: wrapper.run(*args)), ""
    except Exception as error:  # not installed, or its API moved: recorded, the rest runs
        return None, harness.short_error(error)


def sdpa_call(heads: int, batch: int, length: int, tokens: int):
    """SDPA over the decompressed heads of the same shape, or (None, why not)."""
    nbytes = batch * length * heads * (QK_NOPE + ROPE + V_HEAD) * 2
    if nbytes > SDPA_BYTES_LIMIT:
        return None, f"decompressed K/V {nbytes / 2**30:.0f} GiB"
    device, dtype = "cuda", torch.bfloat16
    q = torch.randn(batch, heads, tokens, QK_NOPE + ROPE, dtype=dtype, device=device)
    k = torch.randn(batch, heads, length, QK_NOPE + ROPE, dtype=dtype, device=device)
    v = torch.randn(batch, heads, length, V_HEAD, dtype=dtype, device=device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return (lambda: sdpa(q, k, v)), ""


def main() -> int:
    parser = harness.timing_parser(__doc__.splitlines()[0], repeats=20, warmup=3)
    parser.add_argument("--heads", type=ints, default=[128, 16])
    parser.add_argument("--batches", type=ints, default=[1, 16, 64, 128])
    parser.add_argument("--lengths", type=ints, default=[1024, 4096, 16384, 32768])
    parser.add_argument("--tokens", type=ints, default=[1, 2])
    args = parser.parse_args()
    timer = harness.Timer(args.warmup, args.repeats)
    ceilings = harness.measure_ceilings(timer)
    copy_rate = ceilings["copy_TBps"] * 1e12
    print(
        f"copy rate {ceilings['copy_TBps']:.2f} TB/s, bf16 matmul {ceilings['matmul_TFLOPs']:.0f}"
    )
    rows = []
    for heads in args.heads:
        for batch in args.batches:
            for length in args.lengths:
                for tokens in args.tokens:
                    case = latent_case(heads, batch, length, tokens)
                    names = ["astrai bf16", "astrai fp8"]
                    (bf16_fn, bf16_kernel), (fp8_fn, fp8_kernel) = (
                        astrai_call(case, False),
                        astrai_call(case, True),
                    )
                    fns = [bf16_fn, fp8_fn]
                    kernels = {"astrai bf16": bf16_kernel, "astrai fp8": fp8_kernel}
                    notes = {}
                    for name, (fn, why) in (
                        ("flashinfer bf16", flashinfer_call(case)),
                        ("sdpa decompressed", sdpa_call(heads, batch, length, tokens)),
                    ):
                        if fn is None:
                            notes[name] = why
                        else:
                            names.append(name)
                            fns.append(fn)
                    times = timer.measure_interleaved(fns)
                    shape = f"H={heads} B={batch} L={length} s_q={tokens}"
                    visible = batch * tokens * length  # causal s_q = 2 sees L - 1 and L: ~L
                    flops = 2 * visible * heads * (LATENT + ROPE + LATENT)
                    bf16_us = times[0]["ms"] * 1e3
                    peer = dict(zip(names, times)).get("flashinfer bf16")
                    for name, t in zip(names, times):
                        us = t["ms"] * 1e3
                        element = 1 if name == "astrai fp8" else 2
                        latent_bytes = batch * length * (LATENT * element + ROPE * 2)
                        rate = latent_bytes / (us * 1e-6)
                        row = dict(
                            shape=shape,
                            impl=name,
                            kernel=kernels.get(name, ""),
                            us=us,
                            latent_GBps=rate / 1e9,
                            copy_share=rate / copy_rate,
                            TFLOPs=flops / (us * 1e-6) / 1e12,
                            vs_flashinfer=peer["ms"] * 1e3 / us if peer else None,
                            vs_bf16=us / bf16_us,
                        )
                        rows.append(row)
                        versus = f"{row['vs_flashinfer']:.2f}x" if peer else "-"
                        print(
                            f"{shape:<30} {name:<18} {us:10.1f} us {rate / 1e9:8.0f} GB/s "
                            f"{row['copy_share']:6.1%} {row['TFLOPs']:7.1f} TFLOP/s "
                            f"fi {versus:>6}  bf16 {row['vs_bf16']:.2f}x  {row['kernel']}"
                        )
                    for name, why in notes.items():
                        print(f"{shape:<30} {name:<18} not run: {why}")
                        rows.append(dict(shape=shape, impl=name, skipped=why))
                    del case, fns
                    harness.free_cached()

    env = harness.run_environment(args.repeats, **ceilings)
    lines = [
        f"# Latent attention (MLA): {env['gpu']}, {env['date']}",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, CUDA {env['cuda']}; bf16 queries, "
        f"latent {LATENT} + rope {ROPE}, page {PAGE}, shuffled pages; copy rate "
        f"{ceilings['copy_TBps']:.2f} TB/s; medians of {args.repeats}, L2 emptied before each run.",
        "",
        "| shape | impl | kernel | us | latent GB/s | of copy rate | TFLOP/s | FlashInfer / this | "
        "this / astrai bf16 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['impl']} | | not run: {r['skipped']} | | | | | |")
            continue
        versus = f"{r['vs_flashinfer']:.2f}" if r["vs_flashinfer"] else "-"
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['kernel']} | {r['us']:.1f} | "
            f"{r['latent_GBps']:.0f} | "
            f"{r['copy_share']:.1%} | {r['TFLOPs']:.1f} | {versus} | {r['vs_bf16']:.2f} |"
        )
    stem = harness.write_record(args.out, "mla", env, dict(rows=rows), lines)
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
