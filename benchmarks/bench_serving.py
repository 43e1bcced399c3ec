"""What serving engines ask of attention (issue 51), on the cuda backend: one process, interleaved
timing (benchmarks/harness.py: CUDA events, L2 emptied before each run, medians).

  - verify: a tree of Q = 4 or 8 drafts per sequence (B = 16, 64; L = 2048, 8192; GQA 32/8,
    D = 128, page 16) as a verify (the decode forms), on the prefill kernel (verify_form=never),
    against a one-token decode of the same batch (target: verify at most 1.3x the decode) and
    FlashInfer's prefill wrapper with the same tree as a custom mask over the same pool (target:
    astrai at least 1.2x faster), where FlashInfer imports;
  - batch-invariant mode against the default: decode (B = 1 L = 32768; B = 16, 64 L = 4096;
    B = 128 L = 2048; targets: within 15% at B = 1, 5% from B = 16), with the mode's split size
    and twice it (invariant_split_tiles=32), a ragged prefill with cached prefixes, and the same
    prefill over an FP8 cache.

    python3 benchmarks/bench_serving.py [--out DIR] [--repeats N]

Writes serving_<GPU>_<date>.json and .md with the command, GPU, torch and CUDA versions.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

import astrai.extension as astrai  # noqa: E402  (loads the ops: plain "import astrai" is lazy)

HQ, HKV, D, PAGE = 32, 8, 128, 16
TARGETS = {"verify_vs_decode": 1.3, "flashinfer_vs_verify": 1.2, "invariant_decode": (1.15, 1.05)}


def tree_of_drafts(parents):
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        mask[i, i] = True
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def binary_tree(drafts: int):
    """Draft i follows draft (i - 1) // 2: two candidates per step."""
    return tree_of_drafts([(i - 1) // 2 for i in range(drafts)])


def with_mode(invariant: bool, fn):
    def call():
        torch.ops.astr.set_batch_invariant(invariant)
        return fn()

    return call


def verify_case(batch: int, length: int, drafts: int):
    """The calls of one verify shape: (verify, decode of the same batch, FlashInfer or None)."""
    device = "cuda"
    lengths = [length + drafts] * batch
    k = torch.randn(sum(lengths), HKV, D, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    cache = harness.build_paged_cache(k, v, lengths, PAGE)
    tree = binary_tree(drafts)
    tree_mask = tree.repeat(batch, 1).to(device)
    q = torch.randn(batch * drafts, HQ, D, dtype=torch.bfloat16, device=device)
    starts = harness.query_start_loc([drafts] * batch, device)
    args = dict(
        cache,
        query_start_loc=starts,
        max_query_len=drafts,
        mode="prefill",
        is_causal=True,
        backend="cuda",
    )

    def verify():
        return torch.ops.astr.attention(q, **args, tree_mask=tree_mask)

    q1 = q[::drafts].contiguous()
    decode_args = dict(cache, mode="decode", is_causal=True, backend="cuda")

    def decode():
        return torch.ops.astr.attention(q1, **decode_args)

    flashinfer_call = None
    try:
        import flashinfer
        from peers import flashinfer_page_index

        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        # Each request's mask [drafts, kv_len]: the cached prefix visible, then the tree.
        rows = torch.ones(drafts, length + drafts, dtype=torch.bool)
        rows[:, length:] = tree
        wrapper.plan(
            starts,
            *flashinfer_page_index(cache["block_table"], lengths, PAGE),
            HQ,
            HKV,
            D,
            PAGE,
            custom_mask=rows.reshape(-1).repeat(batch).to(device),
            q_data_type=torch.bfloat16,
        )
        kv = (cache["k_cache"], cache["v_cache"])
        flashinfer_call = lambda: wrapper.run(q, kv)  # noqa: E731
        flashinfer_call()
    except Exception as error:  # not installed, or its API moved: recorded, the rest runs
        print(f"FlashInfer with a custom mask did not run: {str(error).splitlines()[0][:160]}")
        flashinfer_call = None
    return verify, decode, flashinfer_call


def main() -> int:
    parser = harness.timing_parser(__doc__.splitlines()[0])
    args = parser.parse_args()
    timer = harness.Timer(args.warmup, args.repeats)
    rows = []

    def compare(case, names, fns):
        times = timer.measure_interleaved(fns)
        base = times[0]["ms"] * 1e3
        for name, t in zip(names, times):
            us = t["ms"] * 1e3
            rows.append(dict(case=case, form=name, us=us, ratio=us / base))
            print(f"{case:<36} {name:<24} {us:9.1f} us  {us / base:.3f}x")

    for batch in (16, 64):
        for length in (2048, 8192):
            for drafts in (4, 8):
                verify, decode, flashinfer_call = verify_case(batch, length, drafts)
                names = ["decode (1 token)", "verify", "verify on the prefill"]
                fns = [
                    decode,
                    verify,
                    harness.under_tuning("verify_form=never", verify),
                ]
                if flashinfer_call is not None:
                    names.append("flashinfer custom mask")
                    fns.append(flashinfer_call)
                compare(f"B={batch} L={length} Q={drafts}", names, fns)
                harness.free_cached()

    for batch, length in ((1, 32768), (16, 4096), (64, 4096), (128, 2048)):
        q, call_args = harness.uniform_decode_call(batch, length, HQ, HKV, D)

        def decode(q=q, call_args=call_args):
            return torch.ops.astr.attention(q, **call_args, is_causal=True, backend="cuda")

        # The mode's splits of kInvariantSplitTiles (plan.h) and of twice as many tiles.
        compare(
            f"decode B={batch} L={length}",
            ["default", "batch-invariant", "batch-invariant, 32-tile splits"],
            [
                with_mode(False, decode),
                with_mode(True, decode),
                with_mode(True, harness.under_tuning("invariant_split_tiles=32", decode)),
            ],
        )
        harness.free_cached()
    prefixes, chunks = harness.ragged_mix(0, 8, (0, 4096), (256, 2048))
    lengths = [p + c for p, c in zip(prefixes, chunks)]
    k = torch.randn(sum(lengths), HKV, D, dtype=torch.bfloat16, device="cuda")
    cache = harness.build_paged_cache(k, torch.randn_like(k), lengths, PAGE)
    q = torch.randn(sum(chunks), HQ, D, dtype=torch.bfloat16, device="cuda")
    prefill_args = dict(
        query_start_loc=harness.query_start_loc(chunks, "cuda"),
        max_query_len=max(chunks),
        mode="prefill",
        is_causal=True,
        backend="cuda",
    )
    scales = torch.ones(HKV, device="cuda") / 64
    fp8 = dict(
        cache,
        k_cache=(cache["k_cache"].float() * 64).to(torch.float8_e4m3fn),
        v_cache=(cache["v_cache"].float() * 64).to(torch.float8_e4m3fn),
        k_scale=scales,
        v_scale=scales,
    )
    for case, pool in (("prefill ragged 8", cache), ("prefill ragged 8, e4m3 cache", fp8)):

        def prefill(pool=pool):
            return torch.ops.astr.attention(q, **pool, **prefill_args)

        compare(
            case,
            ["default", "batch-invariant"],
            [with_mode(False, prefill), with_mode(True, prefill)],
        )
    astrai.set_batch_invariant(False)

    env = harness.run_environment(args.repeats)
    lines = [
        f"# Serving: verify and batch-invariant mode on the cuda backend: {env['gpu']}, "
        f"{env['date']}",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, CUDA {env['cuda']}; bf16, Hq={HQ}, "
        f"Hkv={HKV}, D={D}, page {PAGE}, shuffled pool; medians of {args.repeats}, L2 emptied "
        "before each run, a case's forms interleaved in one loop; ratio to the case's first row.",
        "",
        "| case | form | us | ratio |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['case']} | {r['form']} | {r['us']:.1f} | {r['ratio']:.3f} |")
    harness.write_record(args.out, "serving", env, dict(rows=rows, targets=TARGETS), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
