"""Where inside the decode kernel the time goes, block by block (GPU diagnostic).

    ASTR_DECODE_TIMELINE=1 pip install --no-build-isolation -e .   # the instrumented build
    python3 benchmarks/decode_timeline.py [--shapes 16x2048,1x32768] [--out DIR]

The instrumented build (csrc/kernels/decode_timeline.cuh) makes thread 0 of every decode block
print %globaltimer stamps: entry, the prologue's copies issued, the first K/V tile landed, the last
tile consumed, the epilogue done. This script runs the cuda backend's decode (bf16, Hq=32, Hkv=8,
D=128, page 16) a few times per shape in a child process, each call after the benchmark's L2
flush, and summarises every call from the first block's entry: how long the prologue and the first
tile take, how the blocks' loop ends spread (the tail, where fewer and fewer blocks stream), and
what the epilogue (the merge) adds. Medians over the calls (the first, cold, call is dropped).
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


def run_calls(shapes: list[tuple[int, int]]) -> None:
    """Child: the decode calls whose blocks print their timelines to stdout."""
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
            timer.evict(i)
            torch.cuda.synchronize()
            print(f"CALL {batch}x{length} {i}", flush=True)
            torch.ops.astr.attention(q, backend="cuda", **kwargs)
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
        rows.append(row)
    return rows


def markdown(rows: list[dict], env: str, command: str) -> str:
    head = "| grid (seq x kv head) | splits | seq_len | blocks | " + " | ".join(
        title for _, title in COLUMNS
    )
    lines = [
        "# Decode kernel timeline (per block, us from the first block's entry)",
        "",
        f"{env}. Command: `{command}` (library built with ASTR_DECODE_TIMELINE=1). bf16, Hq=32,"
        " Hkv=8, D=128, page 16; L2 emptied by a read before each call; medians over the calls.",
        "",
        head + " |",
        "|" + " --- |" * (4 + len(COLUMNS)),
    ]
    for r in rows:
        cells = [str(r["grid_x"]), str(r["splits"]), str(r["seq_len"]), str(r["blocks"])]
        cells += [f"{r[key]:.2f}" for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(f"{b}x{n}" for b, n in SHAPES))
    parser.add_argument("--out", default=None, help="write decode_timeline.md/.txt here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.child:
        run_calls(shapes)
        return
    child = subprocess.run(
        [sys.executable, __file__, "--child", "--shapes", args.shapes],
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
    text = markdown(rows, env, "python3 benchmarks/decode_timeline.py --shapes " + args.shapes)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_timeline.md").write_text(text)
        (out / "decode_timeline_raw.txt").write_text(child.stdout)


if __name__ == "__main__":
    main()
