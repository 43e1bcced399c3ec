"""Does the decode's speed depend on how the pool is laid out, or on a cold block table?
(GPU diagnostic.)

    python3 lab/decode_layout_probe.py [--rounds 3] [--shapes BxLxHkv,...] [--out DIR]

The cuda backend reads any [P, S, Hkv, D] view whose last dim is contiguous, so one pool can be
stored four ways and passed as such a view:

  nhd     [P, S, Hkv, D] storage, page 16 (the benchmark's layout): a kv head's row of a slot is
          256 bytes, 2 KB from the next slot's
  hnd     [P, Hkv, S, D] storage, page 16 (FlashInfer's HND): a kv head's page is 4 KB contiguous
  hmaj    [Hkv, P, S, D] storage, page 16: one pool per kv head, so the 8 blocks of a sequence
          read 8 far-apart places at once instead of one page
  hnd64   [P, Hkv, S, D] storage, page 64: 16 KB contiguous per kv head and page

(decode_kernel_times.py compared nhd and hnd, and page orders, on the kernels of 2026-12-02;
this asks again of the current kernels, with two more layouts, a warm block table and SDPA cuDNN
timed in the same rounds.)

Each is timed cold (the harness's 256 MB read before every call) and warm (the same read,
then the block table, seq_lens and q read again, as in a model whose previous layer just used
them), next to SDPA cuDNN on the contiguous [B, H, L, D] cache (warm: q read again). Rounds of all
variants alternate; the table holds medians over rounds of each round's median. Outputs match the
nhd result (rel L2 < 2e-2) before anything is timed. A call of ~30 us or less can turn host-bound
in the warm form (the extra reads no longer hide the host's dispatch): read those cells as not
measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness  # noqa: E402

HQ, HEAD_DIM = 32, 128
SHAPES = [  # (B, L, Hkv)
    (16, 2048, 8),
    (16, 4096, 8),
    (16, 8192, 8),
    (64, 4096, 8),
    (128, 2048, 8),
    (32, 4096, 32),
    (1, 32768, 8),
    (16, 512, 8),
]
VARIANTS = ["nhd", "hnd", "hmaj", "hnd64", "cudnn"]


def stored_head_major_per_page(cache: torch.Tensor) -> torch.Tensor:
    """[P, S, H, D] values in [P, H, S, D] storage, seen as [P, S, H, D]."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def stored_one_pool_per_head(cache: torch.Tensor) -> torch.Tensor:
    """[P, S, H, D] values in [H, P, S, D] storage, seen as [P, S, H, D]."""
    return cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def probe_shape(timer: harness.Timer, batch: int, length: int, hkv: int, rounds: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch, hkv, length, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    k_tokens = k.transpose(1, 2).reshape(batch * length, hkv, HEAD_DIM)
    v_tokens = v.transpose(1, 2).reshape(batch * length, hkv, HEAD_DIM)
    starts = harness.query_start_loc([1] * batch, "cuda")
    nhd = dict(harness.build_paged_cache(k_tokens, v_tokens, [length] * batch, 16))
    page64 = harness.build_paged_cache(k_tokens, v_tokens, [length] * batch, 64)
    del k_tokens, v_tokens
    caches = {
        "nhd": nhd,
        "hnd": dict(
            nhd,
            k_cache=stored_head_major_per_page(nhd["k_cache"]),
            v_cache=stored_head_major_per_page(nhd["v_cache"]),
        ),
        "hmaj": dict(
            nhd,
            k_cache=stored_one_pool_per_head(nhd["k_cache"]),
            v_cache=stored_one_pool_per_head(nhd["v_cache"]),
        ),
        "hnd64": dict(
            page64,
            k_cache=stored_head_major_per_page(page64["k_cache"]),
            v_cache=stored_head_major_per_page(page64["v_cache"]),
        ),
    }
    del page64
    calls, touches = {}, {}
    for name, cache in caches.items():
        kwargs = dict(cache, query_start_loc=starts, max_query_len=1, mode="decode", backend="cuda")
        calls[name] = lambda kwargs=kwargs: torch.ops.astr.attention(q, **kwargs)
        touches[name] = lambda cache=cache: (
            q.sum(),
            cache["block_table"].sum(),
            cache["seq_lens"].sum(),
        )
    q_sdpa = q.view(batch, HQ, 1, HEAD_DIM)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q_sdpa, k, v, enable_gqa=HQ != hkv)

    calls["cudnn"] = cudnn
    touches["cudnn"] = lambda: q.sum()
    expected = calls["nhd"]().float()
    for name in VARIANTS[1:]:
        out = calls[name]().float().view_as(expected)
        error = float((out - expected).norm() / expected.norm())
        if error > 2e-2:
            raise RuntimeError(f"{name}: rel L2 {error:.2e} against nhd")

    flush = timer.evict
    times: dict = {}
    for _ in range(rounds):
        for warm in (False, True):
            for name in VARIANTS:
                if warm:
                    timer.evict = lambda i, touch=touches[name]: (flush(i), touch())
                times.setdefault((name, warm), []).append(timer.measure(calls[name])["ms"])
                timer.evict = flush
    nbytes = harness.decode_bytes(batch, length, HQ, hkv, HEAD_DIM)
    row = dict(B=batch, L=length, Hkv=hkv)
    for (name, warm), ms in times.items():
        row[name + ("_warm" if warm else "")] = round(harness.median_round(ms, nbytes)[1], 3)
    return row


def markdown(rows: list, copy: float, env: str, command: str) -> str:
    lines = [
        "# Decode: pool layout and a warm block table (astrai cuda backend vs SDPA cuDNN)",
        "",
        f"{env}. Command: `{command}`. bf16, Hq=32, D=128. Effective TB/s (K + V + q + out"
        f" bytes over time); copy ceiling in this run {copy:.2f} TB/s. Cold: L2 emptied by a"
        " 256 MB read before each call; warm: then the block table, seq_lens and q read again.",
        "",
        "| B | L | Hkv | "
        + " | ".join(VARIANTS)
        + " | "
        + " | ".join(f"{v} warm" for v in VARIANTS)
        + " |",
        "|" + " --- |" * (3 + 2 * len(VARIANTS)),
    ]
    for r in rows:
        cells = [str(r["B"]), str(r["L"]), str(r["Hkv"])]
        cells += [f"{r[v]:.2f}" for v in VARIANTS] + [f"{r[v + '_warm']:.2f}" for v in VARIANTS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", default=None, help="BxLxHkv,... (default: SHAPES)")
    parser.add_argument("--out", default=None, help="write decode_layout_probe.md/.json here")
    args = parser.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    import astrai.extension  # noqa: F401  (loads the library)

    torch.manual_seed(0)
    timer = harness.Timer(warmup=3, repeats=args.repeats)
    copy_bytes, copy_ms = harness.copy_rate(timer)
    copy = copy_bytes / (copy_ms / 1e3) / 1e12
    rows = []
    for batch, length, hkv in shapes:
        rows.append(probe_shape(timer, batch, length, hkv, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
        harness.free_cached()
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    command = "python3 lab/decode_layout_probe.py --rounds " + str(args.rounds)
    if args.shapes:
        command += " --shapes " + args.shapes
    text = markdown(rows, copy, env, command)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_layout_probe.md").write_text(text)
        (out / "decode_layout_probe.json").write_text(
            json.dumps(dict(env=env, command=command, copy_TBps=copy, rows=rows), indent=1)
        )


if __name__ == "__main__":
    main()
