"""The cuda kernels at the head dims of issue 48: D = 512 (Gemma 4's global layers) and q/k 192
with v 128 (DeepSeek's MHA form), one process, interleaved timing (benchmarks/harness.py: CUDA
events, L2 emptied before each run, medians).

  - decode (B, L) at D = 512 beside D = 256, bf16, page 16, shuffled pool: TB/s and its share of
    the copy rate (target: D = 512 at >= 85% of the copy rate at B >= 16, L >= 4096);
  - prefill B=1 S=8192 causal at D = 512 beside D = 256: TFLOP/s (target: D = 512 at >= 0.9x
    D = 256's);
  - prefill B=1 S=8192 causal at (192, 128), against torch's cuDNN attention on the contiguous
    equivalent where this torch runs it (target: >= 1.0x cuDNN), and D = 128 beside it.

FLOPs count 2 per multiply-add of both products over the visible (query, key) pairs: a causal
prefill of S tokens is B * H * S^2 * (Dqk + Dv).

    python3 benchmarks/bench_head_dims.py [--out DIR] [--repeats N] [--only decode|prefill]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import astrai.extension  # noqa: E402,F401  (loads the library)

HQ, HKV, PAGE = 32, 8, 16
DECODE_ROWS = [(16, 4096), (16, 8192), (64, 4096), (1, 32768)]
DECODE_HEAD_DIMS = (256, 512)
PREFILL_SEQ = 8192
PREFILL_HEAD_DIMS = ((256, 256), (512, 512), (128, 128), (192, 128))


def attend(q, kwargs):
    return lambda: torch.ops.astr.attention(q, **kwargs)


def decode_bytes(batch, length, d, dv):
    """K and V of every live token read once, q read and the output written (bf16)."""
    return batch * length * HKV * (d + dv) * 2 + batch * HQ * (d + dv) * 2


def decode_row(timer, batch, length, copy_tbps):
    fns, labels = [], []
    for d in DECODE_HEAD_DIMS:
        q, call = harness.uniform_decode_call(batch, length, HQ, HKV, d, PAGE)
        fns.append(attend(q, dict(call, is_causal=True, backend="cuda")))
        labels.append(d)
    times = timer.measure_interleaved(fns)
    row = dict(kind="decode", batch=batch, length=length, us={}, tbps={}, of_copy={})
    for d, t in zip(labels, times):
        us = t["ms"] * 1e3
        tbps = decode_bytes(batch, length, d, d) / (us * 1e-6) / 1e12
        row["us"][d], row["tbps"][d], row["of_copy"][d] = us, tbps, tbps / copy_tbps
    del fns
    harness.free_cached()
    return row


def cudnn_prefill(q, k, v):
    """torch's cuDNN attention over [1, H, S, D] tensors (k and v repeated to q's heads), or the
    reason it does not run here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    try:
        run()
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (recorded, not hidden)
        return None, harness.short_error(error)
    return run, ""


def prefill_row(timer, d, dv, seq, with_cudnn):
    k = torch.randn(seq, HKV, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(seq, HKV, dv, dtype=torch.bfloat16, device="cuda")
    cache = harness.build_paged_cache(k, v, [seq], PAGE)
    q = torch.randn(seq, HQ, d, dtype=torch.bfloat16, device="cuda")
    call = dict(
        cache,
        query_start_loc=harness.query_start_loc([seq], "cuda"),
        max_query_len=seq,
        mode="prefill",
        is_causal=True,
        backend="cuda",
    )
    fns, labels = [attend(q, call)], ["cuda"]
    cudnn_error = ""
    if with_cudnn:
        group = HQ // HKV

        def heads_first(x, repeat):
            return x.repeat_interleave(repeat, dim=1).transpose(0, 1).unsqueeze(0).contiguous()

        run, cudnn_error = cudnn_prefill(
            heads_first(q, 1), heads_first(k, group), heads_first(v, group)
        )
        if run is not None:
            fns.append(run)
            labels.append("cudnn")
    times = timer.measure_interleaved(fns)
    flops = HQ * seq * seq * (d + dv)  # causal: half of S^2 pairs, 2 FLOPs per multiply-add
    row = dict(kind="prefill", head_dims=f"{d}/{dv}", seq=seq, us={}, tflops={})
    for label, t in zip(labels, times):
        row["us"][label] = t["ms"] * 1e3
        row["tflops"][label] = flops / (t["ms"] * 1e-3) / 1e12
    if cudnn_error:
        row["cudnn_error"] = cudnn_error
    row["plan"] = torch.ops.astr.cuda_paged_plan(
        q, **{k: v for k, v in call.items() if k != "backend"}
    )
    del fns, cache
    harness.free_cached()
    return row


def main() -> int:
    parser = harness.timing_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("decode", "prefill"), default=None)
    args = parser.parse_args()
    timer = harness.Timer(args.warmup, args.repeats)
    copy_tbps = harness.copy_tbps(timer)
    print(f"copy rate {copy_tbps:.2f} TB/s")
    rows = []
    for batch, length in DECODE_ROWS if args.only != "prefill" else []:
        row = decode_row(timer, batch, length, copy_tbps)
        rows.append(row)
        print(
            f"decode B={batch:<3} L={length:<6} "
            + "  ".join(
                f"D={d} {row['us'][d]:8.1f} us {row['tbps'][d]:.2f} TB/s "
                f"({row['of_copy'][d] * 100:.0f}% of copy)"
                for d in DECODE_HEAD_DIMS
            )
        )
    for d, dv in PREFILL_HEAD_DIMS if args.only != "decode" else []:
        row = prefill_row(timer, d, dv, PREFILL_SEQ, with_cudnn=d != dv)
        rows.append(row)
        print(
            f"prefill {d}/{dv} S={PREFILL_SEQ} ({row['plan']}) "
            + "  ".join(
                f"{k} {row['us'][k]:8.1f} us {row['tflops'][k]:.0f} TFLOP/s" for k in row["us"]
            )
            + (f"  cudnn: {row['cudnn_error']}" if "cudnn_error" in row else "")
        )

    env = harness.run_environment(args.repeats, copy_tbps=copy_tbps)
    lines = [
        f"# Head dims 512 and 192/128 (cuda backend): {env['gpu']}, {env['date']}",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, CUDA {env['cuda']}; Hq={HQ}, "
        f"Hkv={HKV}, bf16, page {PAGE}, shuffled pool; medians of {args.repeats}, L2 emptied "
        f"before each run, interleaved; copy {copy_tbps:.2f} TB/s.",
        "",
        "| call | " + " | ".join(f"D={d} us (TB/s, of copy)" for d in DECODE_HEAD_DIMS) + " |",
        "| --- | " + " | ".join("---" for _ in DECODE_HEAD_DIMS) + " |",
    ]
    for r in rows:
        if r["kind"] == "decode":
            lines.append(
                f"| decode B={r['batch']} L={r['length']} | "
                + " | ".join(
                    f"{r['us'][d]:.1f} ({r['tbps'][d]:.2f}, {r['of_copy'][d] * 100:.0f}%)"
                    for d in DECODE_HEAD_DIMS
                )
                + " |"
            )
    lines += [
        "",
        "| prefill | plan | cuda us (TFLOP/s) | cuDNN us (TFLOP/s) |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["kind"] == "prefill":
            cudnn = (
                f"{r['us']['cudnn']:.1f} ({r['tflops']['cudnn']:.0f})"
                if "cudnn" in r["us"]
                else r.get("cudnn_error", "-")
            )
            lines.append(
                f"| {r['head_dims']} S={r['seq']} | `{r['plan']}` | "
                f"{r['us']['cuda']:.1f} ({r['tflops']['cuda']:.0f}) | {cudnn} |"
            )
    harness.write_record(args.out, "head_dims", env, dict(rows=rows), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
