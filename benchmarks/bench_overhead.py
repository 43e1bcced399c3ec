"""Host-side cost of one attention call: astr's op (C++ resolver + dispatch) and Python API
against a direct SDPA call, on tiny CPU tensors where the math is negligible; also a paged
decode step through the Python API with and without new tokens to append, an
``attn_backend`` context entered and left around a call, and what making dispatch visible costs
(astrai/extension/visibility.py): the check every call pays while nobody looks, and a call
observed once its form has been seen (the logger at INFO, or a profiler running).

    python3 benchmarks/bench_overhead.py [--iters 5000] [--repeats 31] [--out benchmarks/results]

Each timing is (time of ``--iters`` back-to-back calls) / iters, after a warm-up; every repeat
times all cases in turn (interleaved), and the table gives medians over ``--repeats``. "added" is
the median over repeats of (call - SDPA) in the same repeat, against SDPA on BHLD and against
SDPA plus the BLHD transposes and contiguous copy that the op's torch_native backend also does.
Writes overhead.json (data) and overhead.md (table + command + torch version + CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import astrai.extension as ext
from astrai.extension import visibility


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_interleaved(cases: dict, iters: int, repeats: int) -> dict:
    """Per-call µs of every case; each repeat times every case once, in turn, so load from
    other processes hits all cases alike and paired differences stay meaningful."""
    for fn in cases.values():
        for _ in range(max(iters // 10, 100)):
            fn()
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter_ns()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter_ns() - start) / iters / 1000.0)
    return samples


def summarize(samples: dict, baseline: str, baseline_blhd: str) -> dict:
    """Median, min, and the median of per-repeat differences against the baselines."""
    out = {}
    for name, values in samples.items():
        out[name] = {
            "median_us": statistics.median(values),
            "min_us": min(values),
            "added_vs_sdpa_us": statistics.median(a - b for a, b in zip(values, samples[baseline])),
            "added_vs_sdpa_blhd_us": statistics.median(
                a - b for a, b in zip(values, samples[baseline_blhd])
            ),
            # min over repeats: the least disturbed estimate on a loaded machine
            "added_min_vs_sdpa_us": min(values) - min(samples[baseline]),
            "added_min_vs_sdpa_blhd_us": min(values) - min(samples[baseline_blhd]),
            "samples_us": values,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = "python3 " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])

    # [B, L, H, D] = [1, 1, 1, 8] for the op; SDPA takes [B, H, L, D].
    q, k, v = (torch.randn(1, 1, 1, 8) for _ in range(3))
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))
    op = torch.ops.astr.attention
    op_default = torch.ops.astr.attention.default

    def in_context():
        with ext.attn_backend("torch_native"):
            return ext.attention(q, k, v)

    # One sequence of 5 cached tokens decoding its 6th: each call writes the same slot again.
    cache = ext.PagedKVCache(
        1, num_pages=2, page_size=16, num_kv_heads=1, head_dim=8, dtype=torch.float32
    )
    cache.begin_step([0], [5])
    cache.append(0, torch.randn(5, 1, 8), torch.randn(5, 1, 8))
    cache.begin_step([0], [1])

    cases = {
        "sdpa (F.scaled_dot_product_attention, BHLD)": lambda: F.scaled_dot_product_attention(
            q_t, k_t, v_t
        ),
        "sdpa + BLHD transposes + contiguous": lambda: (
            F.scaled_dot_product_attention(q_t, k_t, v_t).transpose(1, 2).contiguous()
        ),
        "torch.ops.astr.attention (resolver picks)": lambda: op(q, k, v),
        "torch.ops.astr.attention.default (overload)": lambda: op_default(q, k, v),
        "torch.ops.astr.attention(backend='torch_native')": lambda: op(
            q, k, v, backend="torch_native"
        ),
        "astrai.extension.attention (Python API)": lambda: ext.attention(q, k, v),
        "attention in attn_backend('torch_native') (enter + call + exit)": in_context,
        "paged decode, k/v appended (Python API)": lambda: ext.attention(
            q, k, v, kv_cache=cache, fwd="decode"
        ),
        "paged decode, nothing to append (k=v=None)": lambda: ext.attention(
            q, None, None, kv_cache=cache, fwd="decode"
        ),
        # What every call pays while the astrai logger is below INFO and no profiler runs.
        "visibility check alone (logger below INFO, no profiler)": visibility.enabled,
        # A call observed (logger at INFO or a profiler on), its form already seen: the form's
        # key and a dict lookup, no range (no profiler here).
        "torch.ops.astr.attention observed (form seen)": lambda: visibility.run_visibly(
            op, observed_args
        ),
    }
    observed_args = dict(q=q, k=k, v=v)
    # Inference mode (a serving call) and plain grad mode (inputs not requiring grad: the
    # autograd dispatch keys are still visited, as in a training script's eval pass).
    results = {}
    for mode in ("inference_mode", "grad_mode"):
        context = torch.inference_mode() if mode == "inference_mode" else torch.enable_grad()
        with context:
            samples = time_interleaved(cases, args.iters, args.repeats)
        timed = summarize(
            samples,
            "sdpa (F.scaled_dot_product_attention, BHLD)",
            "sdpa + BLHD transposes + contiguous",
        )
        results[mode] = timed

    meta = {
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "shape_blhd": [1, 1, 1, 8],
        "dtype": "float32",
        "iters": args.iters,
        "repeats": args.repeats,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)

    lines = [
        "# Host overhead of one attention call (CPU, tiny tensors)",
        "",
        f"Command: `{command}`  ",
        f"torch {meta['torch']}, Python {meta['python']}, CPU: {meta['cpu']}, "
        f"{meta['threads']} thread(s), q/k/v float32 BLHD {meta['shape_blhd']}; "
        f"median of {args.repeats} repeats of {args.iters} calls.",
        "",
        "| mode | call | median µs | min µs | added vs SDPA µs (median / min) "
        "| added vs SDPA+transposes µs (median / min) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, timed in results.items():
        for name, r in timed.items():
            lines.append(
                f"| {mode} | {name} | {r['median_us']:.2f} | {r['min_us']:.2f} | "
                f"{r['added_vs_sdpa_us']:+.2f} / {r['added_min_vs_sdpa_us']:+.2f} | "
                f"{r['added_vs_sdpa_blhd_us']:+.2f} / {r['added_min_vs_sdpa_blhd_us']:+.2f} |"
            )
    lines.append("")
    with open(os.path.join(args.out, "overhead.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
