# Lab probe, frozen: it runs only at commit 2be0c0e (as benchmarks/decode_pairs_ab.py there).
# It sets the ASTR_TUNE_KERNELS / ASTR_DECODE_* switches,
# which ASTR_KERNEL_TUNING replaces (issue 27).
# To run it: `git worktree add /tmp/at-2be0c0e 2be0c0e`, build the library there and run the
# command below from that checkout (it imports that commit's benchmarks/bench_attention.py).
"""Decode at 2 splits: block pairs against eight-warp blocks, cluster pairs, the merge kernel and
SDPA cuDNN (GPU).

    ASTR_TUNE_KERNELS=1 python3 benchmarks/decode_pairs_ab.py [--rounds 5] [--variants a,b]
        [--shapes BxLxHkv,...] [--head-dim 128] [--page-size 16] [--out DIR]

Where the split rule picks 2 splits (from 89 to 132 (sequence, kv head) pairs on 132 SMs), the cuda
backend runs them as block pairs (one block of two groups of 4 warps, merged in its shared memory),
as a 2-block cluster (merged through distributed shared memory; ASTR_DECODE_BLOCK_PAIRS=0) or as 2
blocks and the merge kernel (ASTR_DECODE_CLUSTER_MERGE=0); one_split runs 1 split instead
(ASTR_DECODE_SPLITS=1: one block of 4 warps per (sequence, kv head), the grid of SDPA cuDNN's
decode kernel at B >= 16); eight_warps runs 1 split as one block of 8 warps per (sequence, kv head)
(ASTR_DECODE_EIGHT_WARPS=1; by default it replaces the block pairs where the block table holds at
most 16384 positions, so `pairs` turns it off); persistent runs 1 split as the persistent eight-
warp decode (ASTR_DECODE_PERSISTENT=1: one block per SM taking the (sequence, kv head) items in
turn), persistent_plain does the same but launches it after its claim counter's reset, not as the
reset's dependent launch (ASTR_DECODE_EARLY_START=0), no_persistent keeps one split on blocks of
4 warps where the rule would run it. The binding
reads the switches on every call, so the variants alternate in one process, round after round: the
table holds the median over rounds of each round's median, with bench_attention.py's timer (256 MB
read before every call, CUDA events), and each variant's kernel time from the profiler. Outputs
agree with torch_native (rel L2 < 2e-2) before anything is timed. The last two shapes are controls
(1 and 33 splits: every variant but one_split runs the same kernels there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as bench  # noqa: E402
from decode_fixed_cost import kernel_us  # noqa: E402

HQ, HEAD_DIM, PAGE_SIZE = 32, 128, 16
SHAPES = [(16, 512, 8), (16, 2048, 8), (16, 4096, 8), (16, 8192, 8), (16, 32768, 8)]
SHAPES += [(12, 2048, 8), (12, 4096, 8), (4, 4096, 32)]
# Controls: 1 split (B=64) and 33 splits (B=1), where every variant runs the same kernels, so
# their spread is the noise of the measurement.
SHAPES += [(64, 4096, 8), (1, 32768, 8)]
SWITCHES = {
    "pairs": {"ASTR_DECODE_BLOCK_PAIRS": "1", "ASTR_DECODE_EIGHT_WARPS": "0"},
    "eight_warps": {"ASTR_DECODE_EIGHT_WARPS": "1"},
    "cluster": {"ASTR_DECODE_BLOCK_PAIRS": "0"},
    "merge_kernel": {"ASTR_DECODE_CLUSTER_MERGE": "0"},
    "one_split": {"ASTR_DECODE_SPLITS": "1"},
    "persistent": {"ASTR_DECODE_PERSISTENT": "1"},
    "persistent_plain": {"ASTR_DECODE_PERSISTENT": "1", "ASTR_DECODE_EARLY_START": "0"},
    "no_persistent": {"ASTR_DECODE_PERSISTENT": "0"},
}
SWITCH_NAMES = ("ASTR_DECODE_BLOCK_PAIRS", "ASTR_DECODE_CLUSTER_MERGE", "ASTR_DECODE_SPLITS")
SWITCH_NAMES += ("ASTR_DECODE_EIGHT_WARPS", "ASTR_DECODE_PERSISTENT", "ASTR_DECODE_EARLY_START")
VARIANTS = list(SWITCHES) + ["cudnn"]
RATIOS = [("eight_warps", "pairs"), ("pairs", "cluster"), ("eight_warps", "cudnn")]
RATIOS += [("persistent", "no_persistent"), ("persistent", "cudnn")]
RATIOS += [("persistent", "persistent_plain")]


def with_switches(switches: dict, call):
    def run():
        for name in SWITCH_NAMES:
            os.environ.pop(name, None)
        os.environ.update(switches)
        return call()

    return run


def ragged_decode_call(batch: int, length: int, hkv: int) -> tuple:
    """A decode step over `batch` sequences of random lengths from 1 to 2 L - 1 (mean about L),
    in a shuffled paged pool: q and the keyword arguments of torch.ops.astr.attention."""
    lengths = torch.randint(1, 2 * length, (batch,)).tolist()
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(sum(lengths), hkv, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    cache = bench.build_paged_cache(k, torch.randn_like(k), lengths, PAGE_SIZE)
    cache["query_start_loc"] = bench.query_start_loc([1] * batch, "cuda")
    return q, dict(cache, max_query_len=1, mode="decode"), lengths


def measure_shape(
    timer: bench.Timer, batch: int, length: int, hkv: int, rounds: int, ragged: bool = False
) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if ragged:
        q, kwargs, lengths = ragged_decode_call(batch, length, hkv)
    else:
        q, kwargs = bench.uniform_decode_call(batch, length, HQ, hkv, HEAD_DIM, PAGE_SIZE)
        lengths = [length] * batch
    expected = torch.ops.astr.attention(q, backend="torch_native", **kwargs).float()
    calls = {
        name: with_switches(switches, lambda: torch.ops.astr.attention(q, backend="cuda", **kwargs))
        for name, switches in SWITCHES.items()
    }
    k = torch.randn(batch, hkv, length, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q_sdpa = q.view(batch, HQ, 1, HEAD_DIM)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=HQ != hkv)

    if not ragged:  # SDPA takes one length per batch
        calls["cudnn"] = cudnn
    for name in SWITCHES:
        out = calls[name]().float()
        error = float((out - expected).norm() / expected.norm())
        if error > 2e-2:
            raise RuntimeError(f"{name} B={batch} L={length}: rel L2 {error:.2e}")
    times: dict = {}
    variants = [name for name in VARIANTS if name in calls]
    for _ in range(rounds):
        for name in variants:
            times.setdefault(name, []).append(timer.measure(calls[name])["ms"])
    kernels = {name: kernel_us(calls[name], timer) for name in variants}
    for name in SWITCH_NAMES:
        os.environ.pop(name, None)
    nbytes = bench.decode_bytes(1, sum(lengths), HQ, hkv, HEAD_DIM)
    nbytes += bench.decode_bytes(batch, 0, HQ, hkv, HEAD_DIM) - bench.decode_bytes(
        1, 0, HQ, hkv, HEAD_DIM
    )
    row = dict(B=batch, L=length, Hkv=hkv, lengths="ragged" if ragged else "uniform")
    for name, ms in times.items():
        median, tbps = bench.median_round(ms, nbytes)
        row[name + "_us"] = round(median * 1e3, 2)
        row[name] = round(tbps, 3)
        row[name + "_kernels"] = kernels[name]
    return row


def length_cell(row: dict) -> str:
    """L, or for a ragged batch (lengths random from 1 to 2 L - 1) "1..2L-1"."""
    if row.get("lengths") == "ragged":
        return f"1..{2 * row['L'] - 1}"
    return str(row["L"])


def markdown(rows: list, copy: float, env: str, command: str) -> str:
    lines = [
        "# Decode at 2 splits: block pairs vs cluster pairs vs the merge kernel vs SDPA cuDNN",
        "",
        f"{env}. Command: `{command}`. bf16, Hq=32, D={HEAD_DIM}, page {PAGE_SIZE}"
        " (shuffled pages)."
        f" Effective TB/s (% of the copy rate measured in this run, {copy:.2f} TB/s; us per call),"
        " L2 emptied by a 256 MB read before each call; then the kernels' device time"
        " (profiler, us).",
        "",
        "| B | L | Hkv | " + " | ".join(VARIANTS + [f"{a} / {b}" for a, b in RATIOS]) + " |",
        "|" + " --- |" * (3 + len(VARIANTS) + len(RATIOS)),
    ]
    for r in rows:
        cells = [str(r["B"]), length_cell(r), str(r["Hkv"])]
        cells += [
            f"{r[v]:.2f} ({100 * r[v] / copy:.0f}%, {r[v + '_us']:.1f})" if v in r else "-"
            for v in VARIANTS
        ]
        cells += [f"{r[a] / r[b]:.3f}" if a in r and b in r else "-" for a, b in RATIOS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Kernel device time (us, profiler, median of 10):", ""]
    lines += [
        "| B | L | Hkv | " + " | ".join(VARIANTS) + " |",
        "|" + " --- |" * (3 + len(VARIANTS)),
    ]
    for r in rows:
        cells = [str(r["B"]), length_cell(r), str(r["Hkv"])]
        for v in VARIANTS:
            ks = r.get(v + "_kernels")
            cells.append(" + ".join(f"{t:.1f}" for t in ks.values()) if ks else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", default=None, help="BxLxHkv,... (default: SHAPES)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--variants", default=None, help="a comma-separated subset of VARIANTS")
    parser.add_argument("--out", default=None, help="write decode_pairs_ab.md/.json here")
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="lengths random from 1 to 2 L - 1 (no cudnn: SDPA takes one length)",
    )
    args = parser.parse_args()
    if "ASTR_TUNE_KERNELS" not in os.environ:
        sys.exit("set ASTR_TUNE_KERNELS=1 (the binding reads the switches only then)")
    import astrai.extension  # noqa: F401  (loads the library)

    global HEAD_DIM, PAGE_SIZE
    HEAD_DIM = args.head_dim
    PAGE_SIZE = args.page_size

    if args.variants:
        chosen = args.variants.split(",")
        unknown = sorted(set(chosen) - set(VARIANTS))
        if unknown:
            sys.exit(f"unknown variants {unknown}; known: {VARIANTS}")
        for name in [n for n in SWITCHES if n not in chosen]:
            del SWITCHES[name]
        VARIANTS[:] = [v for v in VARIANTS if v in chosen]
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    timer = bench.Timer(warmup=3, repeats=args.repeats)
    copy_bytes, copy_ms = bench._copy_ms(timer)
    copy = copy_bytes / (copy_ms / 1e3) / 1e12
    bench.free_cached()
    print(f"copy {copy:.2f} TB/s", flush=True)
    rows = []
    for batch, length, hkv in shapes:
        row = measure_shape(timer, batch, length, hkv, args.rounds, args.ragged)
        print(json.dumps(row), flush=True)
        rows.append(row)
        bench.free_cached()
    props = torch.cuda.get_device_properties(0)
    env = f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    command = "ASTR_TUNE_KERNELS=1 python3 benchmarks/decode_pairs_ab.py " + " ".join(sys.argv[1:])
    text = markdown(rows, copy, env, command.strip())
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_pairs_ab.md").write_text(text)
        result = dict(env=env, command=command, copy_TBps=copy, rows=rows)
        (out / "decode_pairs_ab.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
