"""FP8 KV cache against bf16 on the cuda backend (H200), one process, interleaved timing
(benchmarks/harness.py: CUDA events, L2 emptied before each run, medians).

  - decode (B, L) of the issue's rows: bf16 pool vs the same values in an e4m3 pool (per-head
    scales from the data), page 16, shuffled; the FP8 rate counts FP8 bytes (targets: at most
    0.55x the bf16 time at B >= 16, L >= 4096, i.e. >= 90% of the copy rate; 0.6x at B=1,
    L=32768);
  - prefill (B=1 S=8192; a ragged batch with cached prefixes; B=1 S=8192 with its block table
    padded to 8192 pages; B=1 S=8192 at D = 64, 96, 256): FP8 vs bf16 (target: >= 1.0x), the
    FP8 call as the plan runs it (pages dequantized first while that scratch stays within 256
    MiB, plan.h) and with a kernel reading the bytes (fp8_prefill=in_kernel: the wgmma prefill at
    D = 128, the mma.sync one at the others).

FlashInfer's FP8 decode is a peer of the main benchmark:
`bench_attention.py --peers cuda_ps16,flashinfer_decode_fp8` (benchmarks/peers.py).

    python3 benchmarks/bench_fp8.py [--out DIR] [--repeats N] [--only decode|prefill]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401  (loads the library)

HQ, HKV, D, PAGE = 32, 8, 128, 16
DECODE_ROWS = [(1, 32768), (16, 4096), (16, 8192), (16, 32768), (64, 4096), (128, 2048)]


def fp8_copy(cache: dict, fp8=torch.float8_e4m3fn):
    """The same pools quantized to FP8 with per-head scales from their amax."""
    out = dict(cache)
    largest = torch.finfo(fp8).max
    for name, scale_name in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        pool = cache[name]
        amax = pool.float().abs().amax(dim=(0, 1, 3))
        scale = (amax / largest).clamp_min(1e-12)
        out[name] = (pool.float() / scale.view(1, 1, -1, 1)).clamp(-largest, largest).to(fp8)
        out[scale_name] = scale.float()
    return out


def attend(q, kwargs):
    return lambda: torch.ops.astr.attention(q, **kwargs)


def decode_bytes(batch, length, kv_bytes):
    return batch * length * HKV * D * 2 * kv_bytes + 2 * batch * HQ * D * 2


def main() -> int:
    parser = harness.timing_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("decode", "prefill"), default=None)
    args = parser.parse_args()
    timer = harness.Timer(args.warmup, args.repeats)
    copy_tbps = harness.copy_tbps(timer)
    print(f"copy rate {copy_tbps:.2f} TB/s")
    rows = []
    for batch, length in DECODE_ROWS if args.only != "prefill" else []:
        q, call = harness.uniform_decode_call(batch, length, HQ, HKV, D, PAGE)
        call = dict(call, is_causal=True, backend="cuda")
        cache = {k: call[k] for k in ("k_cache", "v_cache", "block_table", "seq_lens")}
        fp8 = fp8_copy(cache)
        base = dict(call)
        fp8_call = dict(call, **fp8)
        fns = {"bf16": attend(q, base), "fp8": attend(q, fp8_call)}
        times = timer.measure_interleaved(list(fns.values()))
        us = {name: t["ms"] * 1e3 for name, t in zip(fns, times)}
        row = dict(kind="decode", batch=batch, length=length, us=us)
        row["fp8_over_bf16"] = us["fp8"] / us["bf16"]
        row["fp8_tbps"] = decode_bytes(batch, length, 1) / (us["fp8"] * 1e-6) / 1e12
        row["fp8_of_copy"] = row["fp8_tbps"] / copy_tbps
        rows.append(row)
        print(
            f"decode B={batch:<3} L={length:<6} "
            + "  ".join(f"{k} {v:8.1f} us" for k, v in us.items())
            + f"  fp8/bf16 {row['fp8_over_bf16']:.3f}  fp8 {row['fp8_tbps']:.2f} "
            f"TB/s ({row['fp8_of_copy'] * 100:.0f}% of copy)"
        )
        del cache, fp8, call, base, fp8_call, fns
        harness.free_cached()
    mix = harness.ragged_mix(0, 8, (0, 4096), (256, 2048))
    prefill_rows = (  # label, (prefixes, new tokens), padded block-table width, head dim
        ("B=1 S=8192", ([0], [8192]), 0, D),
        ("ragged 8", mix, 0, D),
        ("B=1 S=8192 W=8192", ([0], [8192]), 8192, D),  # a block table padded to 8192 pages
        # The other head dims: the warp-specialised prefill (D = 64, 96, 256) reads dequantized
        # pages only, so reading the bytes is the mma.sync prefill.
        ("B=1 S=8192 D=64", ([0], [8192]), 0, 64),
        ("B=1 S=8192 D=96", ([0], [8192]), 0, 96),
        ("B=1 S=8192 D=256", ([0], [8192]), 0, 256),
    )
    rows_to_run = prefill_rows if args.only != "decode" else []
    for label, (prefixes, chunks), width, head_dim in rows_to_run:
        lengths = [p + c for p, c in zip(prefixes, chunks)]
        k = torch.randn(sum(lengths), HKV, head_dim, dtype=torch.bfloat16, device="cuda")
        cache = harness.build_paged_cache(k, torch.randn_like(k), lengths, PAGE)
        if width:  # columns past every length: never read
            table = cache["block_table"]
            pad = torch.zeros(table.shape[0], width - table.shape[1], dtype=table.dtype)
            cache["block_table"] = torch.cat([table, pad.to(table.device)], dim=1)
        q = torch.randn(sum(chunks), HQ, head_dim, dtype=torch.bfloat16, device="cuda")
        call = dict(
            cache,
            query_start_loc=harness.query_start_loc(chunks, "cuda"),
            max_query_len=max(chunks),
            mode="prefill",
            is_causal=True,
            backend="cuda",
        )
        fp8_call = dict(call, **fp8_copy(cache))
        fns = {
            "bf16": attend(q, call),
            "fp8": attend(q, fp8_call),
            "fp8_in_kernel": harness.under_tuning("fp8_prefill=in_kernel", attend(q, fp8_call)),
        }
        times = timer.measure_interleaved(list(fns.values()))
        us = {name: t["ms"] * 1e3 for name, t in zip(fns, times)}
        row = dict(kind="prefill", case=label, head_dim=head_dim)
        row["block_table_width"] = cache["block_table"].shape[1]
        row.update(us=us, fp8_over_bf16=us["fp8"] / us["bf16"])
        row["fp8_in_kernel_over_bf16"] = us["fp8_in_kernel"] / us["bf16"]
        rows.append(row)
        print(
            f"prefill {label:<18} "
            + "  ".join(f"{k} {v:8.1f} us" for k, v in us.items())
            + f"  fp8/bf16 {row['fp8_over_bf16']:.3f}  in-kernel/bf16 "
            f"{row['fp8_in_kernel_over_bf16']:.3f}"
        )
        del cache, call, fp8_call, fns
        harness.free_cached()

    env = harness.run_environment(args.repeats, copy_tbps=copy_tbps)
    lines = [
        f"# FP8 KV cache against bf16 (cuda backend): {env['gpu']}, {env['date']}",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, CUDA {env['cuda']}; Hq={HQ}, "
        f"Hkv={HKV}, D={D} (unless a row says), page {PAGE}, shuffled pool, e4m3 with per-head "
        f"scales; medians of {args.repeats}, L2 emptied before each run, interleaved; copy "
        f"{copy_tbps:.2f} TB/s.",
        "",
        "| call | bf16 us | fp8 us | fp8 / bf16 | fp8 TB/s (of copy) |",
        "| --- | --- | --- | --- | --- |",
    ]
    decode_lines, prefill_lines = [], []
    for r in rows:
        if r["kind"] == "decode":
            tbps = f"{r['fp8_tbps']:.2f} ({r['fp8_of_copy'] * 100:.0f}%)"
            decode_lines.append(
                f"| decode B={r['batch']} L={r['length']} | {r['us']['bf16']:.1f} | "
                f"{r['us']['fp8']:.1f} | {r['fp8_over_bf16']:.3f} | {tbps} |"
            )
        else:
            prefill_lines.append(
                f"| prefill {r['case']} | {r['block_table_width']} | {r['us']['bf16']:.1f} | "
                f"{r['us']['fp8']:.1f} | {r['fp8_over_bf16']:.3f} | "
                f"{r['us']['fp8_in_kernel']:.1f} | {r['fp8_in_kernel_over_bf16']:.3f} |"
            )
    lines += decode_lines
    if prefill_lines:
        lines += [
            "",
            "Prefill: `fp8` as the plan runs it (pages dequantized first while that scratch, "
            "K and V of sequences x table width pages of bf16, stays within 256 MiB; beyond, "
            "a kernel reads the bytes), `in kernel` forced (`fp8_prefill=in_kernel`: the wgmma "
            "prefill at D = 128, the mma.sync one at the other head dims).",
            "",
            "| call | table width | bf16 us | fp8 us | fp8 / bf16 | in kernel us | "
            "in kernel / bf16 |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += prefill_lines
    harness.write_record(args.out, "fp8", env, dict(rows=rows), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
