"""astrai's prefill kernels against each other and the peers (GPU), all timed interleaved in one
loop per shape (harness.Runner.time_together), one library: each astrai column runs the cuda
backend under its own kernel tuning (torch.ops.astr.set_kernel_tuning around the call), so two
kernels or two rules of the same build compare without a second library. The plan's rules for
the prefill (csrc/kernels/paged_attention/plan.h) are measured this way
(benchmarks/results/decisions.md).

    python3 benchmarks/bench_prefill_kernels.py OUT.json [--tunings auto,prefill_kernel=wgmma]
        [--dims 128] [--peers flashinfer_fa3,sdpa_cudnn] [--repeats 20] [--quick]
    (a tuning of several keys joins them with "+": prefill_kernel=wgmma+fp8_prefill=in_kernel)

Columns: astrai[<tuning>] for each tuning, flashinfer_fa3 (when importable), sdpa_cudnn. Rows:
causal B x S at D = 128 (Hq 32, Hkv 8), the ragged mix of bench_attention, D = 64 and 256 (Hq 16,
Hkv 4), D = 96 (--dims 96), one non-causal row. Not a benchmark of record: bench_attention.py is.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as bench  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402

import astrai.extension  # noqa: E402,F401


def shapes(dims, quick):
    rows = []
    if 128 in dims:
        for b, s in ((1, 1024), (1, 2048), (4, 2048), (2, 4096), (1, 8192), (1, 16384)):
            if quick and (b, s) not in ((1, 2048), (2, 4096), (1, 8192)):
                continue
            rows.append(("square", b, s, 32, 8, 128, True))
        rows.append(("ragged", 8, None, 32, 8, 128, True))
        rows.append(("square", 2, 4096, 32, 8, 128, False))
    if 64 in dims:
        rows.append(("square", 4, 4096, 16, 4, 64, True))
    if 256 in dims:
        rows.append(("square", 2, 4096, 16, 4, 256, True))
    if 96 in dims:  # Phi-3's head dim (Hq = Hkv = 32 there), and the D = 128 rows' GQA
        rows.append(("square", 1, 4096, 32, 32, 96, True))
        rows.append(("square", 2, 4096, 32, 8, 96, True))
        rows.append(("square", 1, 8192, 32, 8, 96, True))
        rows.append(("ragged", 8, None, 32, 8, 96, True))
        rows.append(("square", 2, 4096, 32, 8, 96, False))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tunings", default="auto,prefill_kernel=wgmma")
    parser.add_argument("--dims", default="128,64,256")
    parser.add_argument("--peers", default="flashinfer_fa3,sdpa_cudnn")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    timer = harness.Timer(3, args.repeats)
    ceilings = harness.measure_ceilings(timer)
    runner = harness.Runner(timer, ceilings)
    registry = peers.registry()
    columns = []
    for tuning in args.tunings.split(","):
        make = peers.astrai_attention("cuda", 16)
        # "+" joins the keys of one tuning (the list itself is comma-separated).
        keys = tuning.replace("+", ",")
        columns.append(
            (f"astrai[{tuning}]", make if tuning == "auto" else peers.under_tuning(make, keys))
        )
    for name in filter(None, args.peers.split(",")):
        if name.startswith("flashinfer") and peers.flashinfer_missing():
            print("skip", name, peers.flashinfer_missing())
            continue
        columns.append((name, registry[name].make))
    views = {
        name: (registry[name].view if name in registry else peers.as_tokens) for name, _ in columns
    }
    results = dict(
        env=dict(
            gpu=torch.cuda.get_device_name(),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            build=astrai.extension.ops.BUILD_INFO,
        ),
        ceilings=ceilings,
        rows=[],
    )
    for kind, b, s, hq, hkv, d, causal in shapes(
        {int(x) for x in args.dims.split(",")}, args.quick
    ):
        if kind == "ragged":
            prefix, chunk = harness.ragged_mix(0, b, (0, 4096), (256, 2048))
            problem, ref = bench.ragged_problem(prefix, chunk, hq, hkv, d, "cuda")
            flops = harness.ragged_prefill_flops(prefix, chunk, hq, d)
        else:
            problem, ref = bench.prefill_problem(b, s, hq, hkv, d, "cuda", causal)
            flops = harness.causal_prefill_flops(b, hq, s, d) * (1 if causal else 2)
        label = f"{kind} B={b} S={s} Hq={hq} Hkv={hkv} D={d} {'causal' if causal else 'full'}"
        rows, fns = [], []
        for name, make in columns:
            row = dict(shape=label, peer=name, flops=flops)
            fn = runner.prepare(
                row,
                lambda make=make, problem=problem: make(problem),
                lambda out, name=name, problem=problem: views[name](problem, out),
                ref,
            )
            rows.append(row)
            if fn is not None:
                fns.append((row, fn))
        runner.time_together([r for r, _ in fns], [f for _, f in fns])
        cells = []
        for row in rows:
            if "ms" in row:
                row["TFLOPs"] = flops / (row["ms"] / 1e3) / 1e12
                flag = "" if row.get("verified") else "(UNVERIFIED)"
                cells.append(f"{row['peer']} {row['TFLOPs']:.0f}{flag}")
            else:
                cells.append(f"{row['peer']} ERR {row.get('error', '')[:80]}")
        print(label, "|", " | ".join(cells), flush=True)
        results["rows"] += rows
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
        problem = ref = fns = None  # the shape's tensors go before the next one's
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
