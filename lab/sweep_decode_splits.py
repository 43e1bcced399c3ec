# Lab probe, frozen: it runs only at commit 2be0c0e (as benchmarks/sweep_decode_splits.py there).
# It sets the ASTR_TUNE_KERNELS / ASTR_DECODE_* switches,
# which ASTR_KERNEL_TUNING replaces (issue 27).
# To run it: `git worktree add /tmp/at-2be0c0e 2be0c0e`, build the library there and run the
# command below from that checkout (it imports that commit's benchmarks/bench_attention.py).
"""Sweep the split-KV count of astrai's decode kernel (a tuning run, on the GPU).

    ASTR_TUNE_KERNELS=1 python3 benchmarks/sweep_decode_splits.py --out DIR

For each shape, times the cuda backend's decode with every split count (forced through
ASTR_DECODE_SPLITS, which the binding reads when ASTR_TUNE_KERNELS is set) and with the built-in
heuristic, with bench_attention.py's timer (L2 flushed, CUDA events, medians), and checks each
output against torch_native. Split counts above 1 are timed twice: with the in-block or in-cluster
merge allowed (sm_90 merges 2 splits in a block pair or a cluster, see paged_attention_dispatch.cu;
rows "pair/cluster") and with the merge kernel (ASTR_DECODE_CLUSTER_MERGE=0). Writes
decode_splits.json and decode_splits.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as bench  # noqa: E402

SHAPES = [(1, 32768), (1, 8192), (4, 8192), (16, 2048), (16, 4096), (16, 8192), (64, 4096)]
SPLITS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]  # 0: the heuristic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--splits",
        default=",".join(map(str, SPLITS)),
        help="comma-separated split counts (0: the heuristic)",
    )
    parser.add_argument(
        "--shapes", default=None, help="comma-separated BxL shapes, e.g. 16x2048,64x4096"
    )
    args = parser.parse_args()
    splits_list = [int(s) for s in args.splits.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if "ASTR_TUNE_KERNELS" not in os.environ:
        sys.exit("set ASTR_TUNE_KERNELS=1 (the binding reads ASTR_DECODE_SPLITS only then)")
    import astrai.extension  # noqa: F401  (loads the library)

    torch.manual_seed(0)
    timer = bench.Timer(warmup=3, repeats=30)
    hq, hkv, d = 32, 8, 128
    rows = []
    for batch, length in shapes:
        q, kwargs = bench.uniform_decode_call(batch, length, hq, hkv, d)
        expected = torch.ops.astr.attention(q, backend="torch_native", **kwargs).float()
        nbytes = bench.decode_bytes(batch, length, hq, hkv, d)
        merges = {0: ("pair/cluster", "kernel"), 1: ("-",), 2: ("pair/cluster", "kernel")}
        for splits, merge in [(s, m) for s in splits_list for m in merges.get(s, ("kernel",))]:
            if splits and splits > -(-length // 64):
                continue
            os.environ["ASTR_DECODE_SPLITS"] = str(splits)
            os.environ["ASTR_DECODE_CLUSTER_MERGE"] = "0" if merge == "kernel" else "1"
            out = torch.ops.astr.attention(q, backend="cuda", **kwargs).float()
            err = float((out - expected).norm() / expected.norm())
            ms = timer.measure(
                lambda q=q, kwargs=kwargs: torch.ops.astr.attention(q, backend="cuda", **kwargs)
            )["ms"]
            rows.append(
                dict(
                    B=batch,
                    L=length,
                    splits=splits or "heuristic",
                    merge=merge if splits else f"{merge} if allowed",
                    us=ms * 1e3,
                    TBps=nbytes / (ms * 1e-3) / 1e12,
                    rel_l2=err,
                )
            )
            print(rows[-1], flush=True)
        del q, kwargs
        torch.cuda.empty_cache()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    (out_dir / "decode_splits.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = [
        "# Decode split-KV sweep (astrai cuda backend, bf16, Hq=32, Hkv=8, D=128, page 16)",
        "",
        f"`ASTR_TUNE_KERNELS=1 python3 benchmarks/sweep_decode_splits.py`; {env}",
        "",
        "| B | L | splits | merge | us | TB/s | rel L2 vs torch_native |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['B']} | {r['L']} | {r['splits']} | {r['merge']} | {r['us']:.1f} | {r['TBps']:.2f} "
        f"| {r['rel_l2']:.1e} |"
        for r in rows
    ]
    (out_dir / "decode_splits.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
