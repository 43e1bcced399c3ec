# Lab probe, frozen: it runs only at commit 2be0c0e (as benchmarks/decode_timeline.py there).
# It reads the stamps of the ASTR_DECODE_TIMELINE=1 build
# (csrc/kernels/decode_timeline.cuh), which issue 27 removes from the product kernels.
# To run it: `git worktree add /tmp/at-2be0c0e 2be0c0e`, build the library there and run the
# command below from that checkout (it imports that commit's benchmarks/bench_attention.py).
"""Where inside the decode kernel the time goes, block by block (GPU diagnostic).

    ASTR_DECODE_TIMELINE=1 pip install --no-build-isolation -e .   # the instrumented build
    python3 benchmarks/decode_timeline.py [--shapes 16x2048,1x32768] [--shuffle] [--out DIR]

The instrumented build (csrc/kernels/decode_timeline.cuh) makes thread 0 of every decode block
print %globaltimer stamps: entry, the prologue's copies issued, the first K/V tile landed, the last
tile consumed, the epilogue done. This script runs the cuda backend's decode (bf16, Hq=32, Hkv=8,
D=128, page 16) a few times per shape in a child process, each call after the benchmark's L2
flush, and summarises every call from the first block's entry: how long the prologue and the first
tile take, how the blocks' loop ends spread (the tail, where fewer and fewer blocks stream), and
what the epilogue (the merge) adds. Medians over the calls (the first, cold, call is dropped).
Then per SM (the stamps carry %smid): the fastest and slowest SM's mean loop end, and whether the
same SMs are slow in every call (the correlation of per-SM means between even and odd calls).
Rebuild without the variable before timing anything else: printf costs registers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
# One wave each (2 blocks per SM): with several waves the later blocks wait for the printing ones.
SHAPES = [(16, 512), (16, 2048), (16, 8192), (1, 32768)]
CALLS = 5
COLUMNS = [
    ("prologue_med", "prologue (med)"),
    ("first_tile_min", "first tile (min)"),
    ("first_tile_med", "first tile (med)"),
    ("loop_end_med", "loop end (med)"),
    ("loop_end_max", "loop end (max)"),
    ("epilogue_min", "epilogue (min)"),
    ("epilogue_med", "epilogue (med)"),
    ("end_max", "last block done"),
]
# Per SM over the calls (sm_consistency): its blocks' mean loop end, fastest and slowest SM, and
# how well the even calls' per-SM means predict the odd calls'.
SM_COLUMNS = [
    ("sm_fastest", "SM mean loop end (min)"),
    ("sm_slowest", "SM mean loop end (max)"),
    ("sm_repeat_corr", "SM repeat corr"),
]


def run_calls(shapes: list[tuple[int, int]], shuffle: bool = False) -> None:
    """Child: the decode calls whose blocks print their timelines to stdout. With shuffle, every
    call hands the sequences to the grid in a new order (the block table's rows and q permuted),
    so a block index, and the SM it lands on, reads other pages each time."""
    import ctypes

    import torch

    libc = ctypes.CDLL(None)
    sys.path.insert(0, str(HERE))
    import bench_attention as bench

    import astrai.extension  # noqa: F401  (loads the library)

    torch.manual_seed(0)
    timer = bench.Timer(warmup=0, repeats=1)
    hq, hkv, d = 32, 8, 128
    for batch, length in shapes:
        q, kwargs = bench.uniform_decode_call(batch, length, hq, hkv, d)
        for i in range(CALLS + 1):
            call_q, call_kwargs = q, kwargs
            if shuffle:
                order = torch.randperm(batch, device=q.device)
                call_q = q[order].contiguous()
                call_kwargs = dict(kwargs, block_table=kwargs["block_table"][order].contiguous())
            timer.evict(i)
            torch.cuda.synchronize()
            print(f"CALL {batch}x{length} {i}", flush=True)
            torch.ops.astr.attention(call_q, backend="cuda", **call_kwargs)
            torch.cuda.synchronize()  # the blocks' lines reach C's stdout buffer
            libc.fflush(None)
        del q, kwargs
        torch.cuda.empty_cache()


def parse(lines) -> dict:
    """Child output -> {(grid_x, splits, seq_len): [call, ...]}, a call being its blocks'
    (block_x, split, sm, start, prologue, first_tile, loop_end, end) in ns. A "CALL" line opens
    each call; calls are kept in order, the cold first one included."""
    calls = defaultdict(list)
    current = None
    for line in lines:
        fields = line.split()
        if fields[:1] == ["CALL"]:
            current = {}
            continue
        if len(fields) != 13 or fields[0] != "TL" or current is None:
            continue
        grid_x, splits, block_x, split, seq_len, sm, _tiles = map(int, fields[1:8])
        shape = (grid_x, splits, seq_len)
        if shape not in current:
            current[shape] = []
            calls[shape].append(current[shape])
        current[shape].append((block_x, split, sm) + tuple(map(int, fields[8:13])))
    return dict(calls)


def summarize(call) -> dict:
    """One call's blocks -> the columns, in us from the first block's entry."""

    def q(values, p):
        values = sorted(values)
        return values[min(len(values) - 1, int(p * len(values)))]

    origin = min(r[3] for r in call)
    us = 1e-3
    return dict(
        blocks=len(call),
        prologue_med=statistics.median(r[4] - r[3] for r in call) * us,
        first_tile_min=min(r[5] - r[3] for r in call) * us,
        first_tile_med=statistics.median(r[5] - r[3] for r in call) * us,
        loop_end_med=q([r[6] - origin for r in call], 0.5) * us,
        loop_end_max=max(r[6] - origin for r in call) * us,
        epilogue_min=min(r[7] - r[6] for r in call) * us,
        epilogue_med=statistics.median(r[7] - r[6] for r in call) * us,
        end_max=max(r[7] - origin for r in call) * us,
    )


def per_sm_loop_end(calls: list) -> dict:
    """{sm: mean loop end (us from the call's first entry) of its blocks over these calls}."""
    ends = defaultdict(list)
    for call in calls:
        origin = min(r[3] for r in call)
        for r in call:
            ends[r[2]].append((r[6] - origin) * 1e-3)
    return {sm: statistics.fmean(v) for sm, v in ends.items()}


def sm_consistency(calls: list) -> dict:
    """Is a slow SM slow every time? The spread of the per-SM mean loop end over all calls, and
    the correlation of the per-SM means of the even calls with those of the odd calls (near 1: the
    same SMs finish late in every call, so the tail is structural, not noise)."""
    means = per_sm_loop_end(calls)
    even, odd = per_sm_loop_end(calls[0::2]), per_sm_loop_end(calls[1::2])
    common = [sm for sm in even if sm in odd]
    corr = float("nan")
    if len(common) > 2 and len(calls) > 1:
        corr = statistics.correlation([even[sm] for sm in common], [odd[sm] for sm in common])
    return dict(sm_fastest=min(means.values()), sm_slowest=max(means.values()), sm_repeat_corr=corr)


def report(calls: dict) -> list[dict]:
    rows = []
    for (grid_x, splits, seq_len), groups in calls.items():
        full = max(len(g) for g in groups)
        kept = [summarize(g) for g in groups[1:] if len(g) == full]  # drop the cold call
        if not kept:
            continue
        row = dict(grid_x=grid_x, splits=splits, seq_len=seq_len, blocks=full, calls=len(kept))
        for key, _ in COLUMNS:
            row[key] = statistics.median(s[key] for s in kept)
        row.update(sm_consistency([g for g in groups[1:] if len(g) == full]))
        rows.append(row)
    return rows


def markdown(rows: list[dict], env: str, command: str) -> str:
    head = "| grid (seq x kv head) | splits | seq_len | blocks | " + " | ".join(
        title for _, title in COLUMNS + SM_COLUMNS
    )
    lines = [
        "# Decode kernel timeline (per block, us from the first block's entry)",
        "",
        f"{env}. Command: `{command}` (library built with ASTR_DECODE_TIMELINE=1). bf16, Hq=32,"
        " Hkv=8, D=128, page 16; L2 emptied by a read before each call; medians over the calls.",
        "",
        head + " |",
        "|" + " --- |" * (4 + len(COLUMNS) + len(SM_COLUMNS)),
    ]
    for r in rows:
        cells = [str(r["grid_x"]), str(r["splits"]), str(r["seq_len"]), str(r["blocks"])]
        cells += [f"{r[key]:.2f}" for key, _ in COLUMNS + SM_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    parser.add_argument("--out", default=None, help="write decode_timeline.md/.txt here")
    parser.add_argument(
        "--shuffle", action="store_true", help="new sequence order every call (see run_calls)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.child:
        run_calls(shapes, args.shuffle)
        return
    child = subprocess.run(
        [sys.executable, __file__, "--child", "--shapes", args.shapes]
        + (["--shuffle"] if args.shuffle else []),
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    if child.returncode != 0:
        sys.exit(child.stderr[-4000:])
    rows = report(parse(child.stdout.splitlines()))
    if not rows:
        sys.exit("no timeline lines: build the library with ASTR_DECODE_TIMELINE=1 (see the top)")
    import torch

    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    command = "python3 benchmarks/decode_timeline.py --shapes " + args.shapes
    text = markdown(rows, env, command + (" --shuffle" if args.shuffle else ""))
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "decode_timeline_shuffled" if args.shuffle else "decode_timeline"
        (out / f"{stem}.md").write_text(text)
        (out / f"{stem}_raw.txt").write_text(child.stdout)


if __name__ == "__main__":
    main()
