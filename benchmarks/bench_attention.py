"""Attention benchmark: astrai's paged op against FlashInfer and torch SDPA, side by side in one
process, and (A/B) against another build of astrai loaded into the same process.

    python3 benchmarks/bench_attention.py                 # the run of record (make bench), < 8 min
    python3 benchmarks/bench_attention.py --quick         # fewer shapes, < 3 min
    python3 benchmarks/bench_attention.py --only decode --peers cuda,sdpa_cudnn
    bash benchmarks/build_baseline.sh 2be0c0e /tmp/baseline   # an older commit, namespace astr_old
    python3 benchmarks/bench_attention.py --baseline-lib /tmp/baseline/astrai/_C.abi3.so
    python3 benchmarks/bench_attention.py --smoke         # tiny shapes, CPU too: the code paths

peers.py lists the peers and what each runs (--peers takes names or the groups astrai, cuda,
before, flashinfer, fp8, sdpa); harness.py is how they are measured; report.py writes the
outputs. Method (benchmarks/README.md has the details): ceilings measured in the same process
(4 GiB device-to-device copy, bytes read + written; bf16 8192^3 matmul); every peer's first
output is compared with a float32 reference (rel L2 recorded); then warm-up and the median of
--repeats CUDA-event timings, a 256 MB buffer read between runs to flush L2 (--flush). A peer
that raises is recorded with its error and the run goes on. Outputs (under --out):
bench_<gpu>_<date>.json/.md, decode_tbps.png, prefill_tflops.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import peers as peer_registry  # noqa: E402
import report  # noqa: E402
from harness import DTYPE, VERIFY_TOLERANCE  # noqa: E402
from peers import AttentionProblem, Peer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "benchmarks/bench_attention.py"


# --------------------------------------------------------------------------------------------
# Shapes of record
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shapes:
    hq: int
    hkv: int
    head_dim: int
    decode: Tuple[Tuple[int, int, int], ...]  # (B, L, Hkv)
    decode_sweep_batch: int
    decode_sweep_lengths: Tuple[int, ...]
    prefill: Tuple[Tuple[int, int, int, int], ...]  # (B, S, H, D), each as GQA and as MHA
    gqa_group: int  # the GQA rows use H / gqa_group kv heads
    ragged: dict  # batch, prefix and chunk (inclusive length ranges)
    prefill_sweep: Tuple[int, ...]  # S at B=1, H=hq, Hkv=hkv, D=head_dim
    copy_bytes: int = 4 << 30  # the copy ceiling's size
    matmul_n: int = 8192  # the matmul ceiling's size


FULL = Shapes(
    hq=32,
    hkv=8,
    head_dim=128,
    decode=((1, 32768, 8), (16, 4096, 8), (64, 4096, 8), (128, 2048, 8), (32, 4096, 32)),
    decode_sweep_batch=16,
    decode_sweep_lengths=(512, 1024, 2048, 4096, 8192, 16384, 32768),
    prefill=(
        (4, 2048, 32, 128),
        (2, 4096, 32, 128),
        (1, 8192, 32, 128),
        (1, 16384, 32, 128),
        (4, 4096, 16, 64),
        (2, 4096, 16, 256),
        (2, 4096, 32, 96),
    ),
    gqa_group=4,
    ragged=dict(batch=8, prefix=(0, 4096), chunk=(256, 2048)),
    prefill_sweep=(1024, 2048, 4096, 8192, 16384),
)
QUICK = replace(
    FULL,
    decode_sweep_lengths=(512, 2048, 8192, 32768),
    prefill=(FULL.prefill[0], FULL.prefill[1], FULL.prefill[4], FULL.prefill[5]),
    prefill_sweep=(1024, 4096, 16384),
)
# The code paths at toy sizes, on the CPU too: not a measurement. D=64 is a head dim of the cuda
# kernels, so on a GPU every peer runs.
SMOKE = Shapes(
    hq=4,
    hkv=2,
    head_dim=64,
    decode=((3, 40, 2),),
    decode_sweep_batch=3,
    decode_sweep_lengths=(24, 40),
    prefill=((2, 40, 4, 16),),
    gqa_group=2,
    ragged=dict(batch=3, prefix=(0, 30), chunk=(1, 20)),
    prefill_sweep=(16, 40),
    copy_bytes=64 << 20,
    matmul_n=256,
)


# --------------------------------------------------------------------------------------------
# The inputs of each kind of row
# --------------------------------------------------------------------------------------------
def decode_problem(
    batch: int, length: int, hq: int, hkv: int, head_dim: int, device
) -> Tuple[AttentionProblem, torch.Tensor]:
    """One decode step (one new token per sequence, `length` cached tokens each) and its
    reference, float32 [B, Hq, D]."""
    q = torch.randn(batch, hq, head_dim, dtype=DTYPE, device=device)  # [T = B, Hq, D]
    k = torch.randn(batch, hkv, length, head_dim, dtype=DTYPE, device=device)  # SDPA layout
    v = torch.randn_like(k)
    q_sdpa = q.view(batch, hq, 1, head_dim)
    ref = harness.reference_attention(q_sdpa, k, v).view(batch, hq, head_dim)
    problem = AttentionProblem(
        "decode", q, [length] * batch, [1] * batch, False, dense=(q_sdpa, k, v)
    )
    return problem, ref


def prefill_problem(
    batch: int, seq: int, hq: int, hkv: int, head_dim: int, device, causal: bool = True
) -> Tuple[AttentionProblem, torch.Tensor]:
    """A square prefill (causal, or every token seeing every key) of `batch` sequences of `seq`
    tokens and its reference, float32 [T, Hq, D]."""
    tokens = batch * seq
    q_tokens = torch.randn(tokens, hq, head_dim, dtype=DTYPE, device=device)  # [T, Hq, D]
    k_tokens = torch.randn(tokens, hkv, head_dim, dtype=DTYPE, device=device)
    v_tokens = torch.randn_like(k_tokens)

    def bhsd(x):  # [T, H, D] -> contiguous [B, H, S, D]
        return x.view(batch, seq, x.shape[1], head_dim).transpose(1, 2).contiguous()

    q, k, v = bhsd(q_tokens), bhsd(k_tokens), bhsd(v_tokens)
    ref = harness.reference_attention(q, k, v, is_causal=causal)
    ref = ref.transpose(1, 2).reshape(tokens, hq, head_dim)
    problem = AttentionProblem(
        "prefill",
        q_tokens,
        [seq] * batch,
        [seq] * batch,
        causal,
        dense=(q, k, v),
        k_tokens=k_tokens,
        v_tokens=v_tokens,
    )
    return problem, ref


def ragged_problem(
    prefix: Sequence[int], chunk: Sequence[int], hq: int, hkv: int, head_dim: int, device
) -> Tuple[AttentionProblem, torch.Tensor]:
    """Chunked prefill: sequences with cached prefixes and new-token chunks of these lengths, in
    one call; new token i of a sequence with p cached tokens sees keys 0 .. p + i. Returns the
    problem and its reference, float32 [T, Hq, D]."""
    lengths = [p + c for p, c in zip(prefix, chunk)]
    q_tokens = torch.randn(sum(chunk), hq, head_dim, dtype=DTYPE, device=device)
    k_tokens = torch.randn(sum(lengths), hkv, head_dim, dtype=DTYPE, device=device)
    v_tokens = torch.randn_like(k_tokens)
    seqs = []  # per sequence: q [1, Hq, c, D], k/v [1, Hkv, L, D], mask [c, L]
    q_off = kv_off = 0
    for p, c in zip(prefix, chunk):
        length = p + c
        per = [
            x[o : o + n].transpose(0, 1).unsqueeze(0).contiguous()
            for x, o, n in (
                (q_tokens, q_off, c),
                (k_tokens, kv_off, length),
                (v_tokens, kv_off, length),
            )
        ]
        mask = (
            torch.arange(length, device=device)[None, :]
            <= p + torch.arange(c, device=device)[:, None]
        )
        seqs.append((*per, mask))
        q_off, kv_off = q_off + c, kv_off + length
    ref = torch.cat(
        [
            harness.reference_attention(qs, ks, vs, attn_mask=m)[0].transpose(0, 1)
            for qs, ks, vs, m in seqs
        ]
    )
    problem = AttentionProblem(
        "prefill",
        q_tokens,
        lengths,
        list(chunk),
        True,
        per_sequence=seqs,
        k_tokens=k_tokens,
        v_tokens=v_tokens,
    )
    return problem, ref


# --------------------------------------------------------------------------------------------
# Running the peers of one shape
# --------------------------------------------------------------------------------------------
class Bench:
    """The peers of a run and what stops some of them before they start (astrai or the
    baseline not importable), around the harness's Runner."""

    def __init__(
        self,
        runner: harness.Runner,
        peers: Sequence[Peer],
        unavailable: Dict[str, str],
        progress: Callable[[dict], None] = lambda row: print(report.progress_line(row), flush=True),
    ):
        self.runner, self.peers = runner, list(peers)
        self.unavailable = unavailable  # peer family -> error of every row of that family
        self.progress = progress

    def run(self, problem: AttentionProblem, ref: torch.Tensor, base: dict) -> List[dict]:
        rows = []
        peers = [p for p in self.peers if problem.kind in p.kinds]
        for group in peer_registry.timing_groups(peers):
            if group[0].page_size is None:
                problem.release_tokens()  # the paged peers are done
            prepared = []
            for peer in group:
                row = self.start_row(peer, problem, base)
                if "error" not in row:
                    fn = self.runner.prepare(
                        row,
                        partial(peer.make, problem),
                        partial(peer.view, problem),
                        ref,
                        peer.tolerance,
                    )
                    if fn is not None:
                        prepared.append((row, fn))
                rows.append(row)
            if prepared:
                self.runner.time_together([r for r, _ in prepared], [f for _, f in prepared])
            for row in rows[-len(group) :]:
                self.progress(row)
        problem.release_tokens()
        return rows

    def start_row(self, peer: Peer, problem: AttentionProblem, base: dict) -> dict:
        row = dict(base, peer=peer.name, family=peer.family)
        if peer.page_size:
            row["page_size"] = peer.page_size
        if peer.partner:
            row["partner"] = peer.partner
        if peer.tolerance != VERIFY_TOLERANCE:
            row["tolerance"] = peer.tolerance
        if problem.kind == "decode":
            row["bytes"] = peer_registry.rate_bytes(peer, row)
        row.update(peer.notes(problem))
        reason = peer.skip(problem)
        if reason:
            row["error"] = "skipped: " + reason
        elif peer.family in self.unavailable:
            row["error"] = self.unavailable[peer.family]
        return row


def finish_decode_rows(rows: List[dict], ceilings: dict) -> None:
    for row in rows:
        if "ms" in row:
            row["TBps"] = row["bytes"] / harness.ms_to_s(row["ms"]) / 1e12
            row["pct_copy"] = 100 * row["TBps"] / ceilings["copy_TBps"]


def finish_prefill_rows(rows: List[dict], ceilings: dict) -> None:
    for row in rows:
        if "ms" in row:
            row["TFLOPs"] = row["flops"] / harness.ms_to_s(row["ms"]) / 1e12
            row["pct_matmul"] = 100 * row["TFLOPs"] / ceilings["matmul_TFLOPs"]


def run_decode_shape(
    bench: Bench, batch: int, length: int, hkv: int, hq: int, head_dim: int
) -> List[dict]:
    problem, ref = decode_problem(batch, length, hq, hkv, head_dim, bench.runner.device)
    nbytes = harness.decode_bytes(batch, length, hq, hkv, head_dim)
    base = dict(kind="decode", B=batch, L=length, Hq=hq, Hkv=hkv, D=head_dim, bytes=nbytes)
    base["floor_us"] = nbytes / bench.runner.ceilings["copy_TBps"] / 1e6
    rows = bench.run(problem, ref, base)
    finish_decode_rows(rows, bench.runner.ceilings)
    return rows


def run_prefill_shape(
    bench: Bench, batch: int, seq: int, hq: int, hkv: int, head_dim: int, causal: bool = True
) -> List[dict]:
    problem, ref = prefill_problem(batch, seq, hq, hkv, head_dim, bench.runner.device, causal)
    # Non-causal: every (query, key) pair, twice the causal count.
    flops = harness.causal_prefill_flops(batch, hq, seq, head_dim) * (1 if causal else 2)
    base = dict(kind="prefill", B=batch, S=seq, Hq=hq, Hkv=hkv, D=head_dim, flops=flops)
    base["causal"] = causal
    rows = bench.run(problem, ref, base)
    finish_prefill_rows(rows, bench.runner.ceilings)
    return rows


def run_ragged_prefill(
    bench: Bench, hq: int, hkv: int, head_dim: int, seed: int, mix: dict
) -> List[dict]:
    prefix, chunk = harness.ragged_mix(seed, mix["batch"], mix["prefix"], mix["chunk"])
    problem, ref = ragged_problem(prefix, chunk, hq, hkv, head_dim, bench.runner.device)
    base = dict(
        kind="prefill",
        B=len(chunk),
        S="ragged",
        T=sum(chunk),
        Hq=hq,
        Hkv=hkv,
        D=head_dim,
        flops=harness.ragged_prefill_flops(prefix, chunk, hq, head_dim),
        prefix_lens=prefix,
        chunk_lens=chunk,
        max_kv_len=max(problem.kv_lens),
    )
    rows = bench.run(problem, ref, base)
    finish_prefill_rows(rows, bench.runner.ceilings)
    return rows


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------
def driver_version() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        lines = out.stdout.strip().splitlines()
        return lines[0] if out.returncode == 0 and lines else None
    except Exception:
        return None


def tree_commit() -> Optional[str]:
    """The checkout's commit, with "+changes" when the library's sources differ from it; None
    outside a git checkout (the device machine gets a copy without .git)."""

    def git(*words: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", "-C", ROOT, *words], capture_output=True, text=True)
        except OSError:
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if head is None:
        return None
    changes = git("status", "--porcelain", "--", "csrc", "astrai", "setup.py")
    return head + ("+changes" if changes else "")


def collect_env(command: str, info: dict, device: torch.device) -> dict:
    env = dict(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
        python=platform.python_version(),
        command=command,
        commit=tree_commit(),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            compute_capability=list(torch.cuda.get_device_capability(device)),
            memory_GiB=round(props.total_memory / 2**30, 1),
            l2_MB=round(getattr(props, "L2_cache_size", 0) / 1e6, 1) or None,
            driver=driver_version(),
        )
    else:
        env.update(gpu=f"cpu-{platform.machine()}", sms=None, driver=None)
    env.update(info)
    return env


def load_astrai() -> Tuple[str, dict]:
    """Import astrai's library; an import failure becomes the error of every astrai peer."""
    try:
        import astrai.extension  # noqa: F401  (loads the library, registers the ops)

        info = {"astrai_build": json.loads(torch.ops.astr.build_info())}
    except Exception as exc:
        return f"astrai not importable: {harness.short_error(exc)}", {"astrai_build": {}}
    try:
        from astrai.extension.backend.flash import probe_flash

        info["flash_probe"] = probe_flash().reason
    except Exception as exc:
        info["flash_probe"] = f"probe failed: {harness.short_error(exc)}"
    return "", info


def load_baseline(lib: Optional[str], namespace: str) -> Tuple[str, dict]:
    """Loads the baseline build (its ops under torch.ops.<namespace>); without a library, the
    namespace must be registered already (namespace "astr": an A/A run against this build).
    Returns an error for every baseline row ("" when loaded) and what to record of it."""
    info: dict = dict(namespace=namespace, lib=lib)
    if lib:
        commit_file = os.path.join(os.path.dirname(os.path.dirname(lib)), "BASELINE.json")
        if os.path.exists(commit_file):
            with open(commit_file) as f:
                info.update({k: v for k, v in json.load(f).items() if k != "namespace"})
        try:
            torch.ops.load_library(lib)
        except Exception as exc:
            return f"baseline library not loaded: {harness.short_error(exc)}", info
    try:
        info["build"] = json.loads(getattr(torch.ops, namespace).build_info())
    except Exception as exc:
        hint = "" if lib else " (load the baseline build with --baseline-lib)"
        return (
            f"baseline namespace {namespace!r} has no ops{hint}: {harness.short_error(exc)}",
            info,
        )
    if namespace == "astr":
        info["note"] = "A/A: the baseline is this build itself"
    return "", info


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=SCRIPT,
        description="astrai attention (paged cuda / torch_native / flash) against FlashInfer and "
        "torch SDPA, and against another astrai build: decode TB/s and causal prefill TFLOP/s, "
        "with copy and matmul ceilings measured in the same run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="peers: "
        + ", ".join(peer_registry.ALL_PEERS)
        + "\ngroups: "
        + ", ".join(f"{g} = {'+'.join(p)}" for g, p in peer_registry.PEER_GROUPS.items()),
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer shapes and repeats (< 3 min)")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="toy shapes on the GPU, or the CPU where there is none: runs every code path, "
        "measures nothing of note (default --out: a new temporary folder)",
    )
    parser.add_argument("--only", choices=["decode", "prefill"], help="run one half only")
    parser.add_argument(
        "--peers",
        "--backends",
        dest="peers_spec",
        metavar="LIST",
        help="comma-separated peers or groups (default: every peer but the FP8 ones, plus "
        "cuda_ps16_before with a baseline), e.g. cuda,torch_native,sdpa_cudnn",
    )
    parser.add_argument("--out", help="output folder (default: benchmarks/results)")
    parser.add_argument(
        "--non-causal",
        action="store_true",
        help="prefill rows without the causal mask (FLOPs: 4*B*H*S*S*D; no ragged rows)",
    )
    parser.add_argument("--repeats", type=int, help="timed runs per peer (default 30; --quick 20)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default 5; --quick 3)")
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed (inputs, page order, ragged mix)"
    )
    parser.add_argument(
        "--flush",
        choices=sorted(harness.FLUSH_MODES),
        default="read",
        help="how L2 is emptied before each timed run: read (default; cold, clean) or write "
        "(cold, dirty: the flush's write-back lands in the timed call, as before 2026-12-02)",
    )
    parser.add_argument(
        "--baseline-lib",
        metavar="PATH",
        help="another build of astrai's library whose op namespace was renamed "
        "(benchmarks/build_baseline.sh makes one): loaded into this process, its *_before peers "
        "run the same calls, and the report gives each row's after/before ratio",
    )
    parser.add_argument(
        "--baseline-namespace",
        metavar="NS",
        help="the baseline's op namespace (default astr_old; astr without --baseline-lib: an "
        "A/A run of this build against itself, the noise of the comparison)",
    )
    args = parser.parse_args(argv)
    args.with_baseline = args.baseline_lib is not None or args.baseline_namespace is not None
    args.baseline_namespace = args.baseline_namespace or "astr_old"
    if args.baseline_lib:
        args.baseline_lib = os.path.abspath(args.baseline_lib)
        if not os.path.isfile(args.baseline_lib):
            parser.error(f"--baseline-lib: no file {args.baseline_lib}")
    try:
        args.peers = peer_registry.select_peers(args.peers_spec, args.with_baseline)
    except ValueError as exc:
        parser.error(f"--peers: {exc}")
    if not args.with_baseline and any(p in peer_registry.BASELINE_PEERS for p in args.peers):
        parser.error("--peers: the *_before peers need --baseline-lib (or --baseline-namespace)")
    args.shapes = SMOKE if args.smoke else QUICK if args.quick else FULL
    default_repeats, default_warmup = (3, 1) if args.smoke else (20, 3) if args.quick else (30, 5)
    args.repeats = args.repeats if args.repeats is not None else default_repeats
    args.warmup = args.warmup if args.warmup is not None else default_warmup
    if args.repeats < 1:
        parser.error("--repeats: must be at least 1")
    if args.out is None:
        args.out = (
            tempfile.mkdtemp(prefix="bench_attention_smoke_")
            if args.smoke
            else os.path.join(ROOT, "benchmarks", "results")
        )
    return args


def reproduce_command(argv: Sequence[str]) -> str:
    return " ".join(["python3", SCRIPT] + [shlex.quote(a) for a in argv])


def row_command(args: argparse.Namespace, row: dict) -> str:
    """A command that re-runs one peer of a row."""
    words = ["python3", SCRIPT]
    words += ["--quick"] if args.quick else ["--smoke"] if args.smoke else []
    words += ["--only", row["kind"], "--peers", row["peer"]]
    if row.get("partner"):
        if args.baseline_lib:
            words += ["--baseline-lib", args.baseline_lib]
        words += ["--baseline-namespace", args.baseline_namespace]
    return " ".join(shlex.quote(w) for w in words)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = reproduce_command(argv)
    print(f"command: {command}", flush=True)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.smoke:
        device = torch.device("cpu")
    else:
        print(f"{SCRIPT}: no CUDA device visible; it times GPU kernels (--smoke runs on the CPU)")
        return 2
    started = time.time()
    torch.manual_seed(args.seed)
    unavailable: Dict[str, str] = {}
    astrai_error, info = load_astrai()
    if astrai_error:
        unavailable["astrai"] = astrai_error
        print(astrai_error, flush=True)
    if args.with_baseline:
        baseline_error, info["baseline"] = load_baseline(args.baseline_lib, args.baseline_namespace)
        if baseline_error:
            unavailable["astrai_before"] = baseline_error
            print(baseline_error, flush=True)
    shapes: Shapes = args.shapes
    result = dict(
        env=collect_env(command, info, device),
        method=dict(
            timing=f"{'CUDA events' if device.type == 'cuda' else 'host clock'}, "
            f"{args.warmup} warm-up, median of {args.repeats}, "
            + (harness.FLUSH_MODES[args.flush] if device.type == "cuda" else "no flush")
            + ("; each *_before peer interleaved with its partner" if args.with_baseline else ""),
            verify=f"first output vs float32 reference (rel L2, tolerance {VERIFY_TOLERANCE:g}; "
            f"FP8 peers {peer_registry.FP8_TOLERANCE:g})",
            decode_bytes="2*B*L*Hkv*D*2 (K+V) + 2*B*Hq*D*2 (q + out); FP8 K/V: 1 byte",
            prefill_flops="2*B*Hq*S*S*D causal square; ragged: 4*D*Hq*visible pairs",
        ),
        args=dict(
            quick=args.quick,
            smoke=args.smoke,
            only=args.only,
            non_causal=args.non_causal,
            peers=args.peers,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
        ),
        rows=[],
        sets={},
    )
    print(json.dumps(result["env"]), flush=True)
    timer = harness.Timer(args.warmup, args.repeats, args.flush, device)
    result["ceilings"] = harness.measure_ceilings(timer, shapes.copy_bytes, shapes.matmul_n)
    c = result["ceilings"]
    print(
        f"ceilings: copy {c['copy_TBps']:.2f} TB/s, matmul {c['matmul_TFLOPs']:.0f} TFLOP/s",
        flush=True,
    )
    runner = harness.Runner(timer, result["ceilings"])
    registry = peer_registry.registry(args.baseline_namespace)
    bench = Bench(runner, [registry[name] for name in args.peers], unavailable)
    done: Dict[tuple, List[dict]] = {}

    def measure(set_name: str, key: tuple, run: Callable[[], List[dict]]) -> None:
        if key not in done:
            try:
                rows = run()
            except Exception as exc:  # inputs or reference failed (e.g. out of memory): go on
                rows = []
                message = harness.short_error(exc)
                result.setdefault("shape_errors", []).append(dict(shape=list(key), error=message))
                print(f"{key}: shape failed: {message}", flush=True)
                runner.check_context(dict(peer="inputs/reference"))
            harness.free_cached(device)  # the shape's tensors died with run()
            for row in rows:
                row["cmd"] = row_command(args, row)
            done[key] = rows
            result["rows"] += rows
        for row in done[key]:
            row.setdefault("sets", [])
            if set_name not in row["sets"]:
                row["sets"].append(set_name)
        result["sets"].setdefault(set_name, [])
        if list(key) not in result["sets"][set_name]:
            result["sets"][set_name].append(list(key))
        result["elapsed_s"] = time.time() - started
        report.write_json(result, args.out)  # partial results survive a crash

    hq, hkv, head_dim = shapes.hq, shapes.hkv, shapes.head_dim
    if args.only in (None, "decode"):
        for b, length, kv_heads in shapes.decode:
            run = partial(run_decode_shape, bench, b, length, kv_heads, hq, head_dim)
            measure("decode", ("decode", b, length, None, hq, kv_heads, head_dim), run)
        b = shapes.decode_sweep_batch
        for length in shapes.decode_sweep_lengths:
            run = partial(run_decode_shape, bench, b, length, hkv, hq, head_dim)
            measure("decode_sweep", ("decode", b, length, None, hq, hkv, head_dim), run)
    if args.only in (None, "prefill"):
        causal = not args.non_causal
        for b, s, h, d in shapes.prefill:
            for kv_heads in (h // shapes.gqa_group, h):
                run = partial(run_prefill_shape, bench, b, s, h, kv_heads, d, causal)
                measure("prefill", ("prefill", b, None, s, h, kv_heads, d), run)
        for kv_heads in (hq // shapes.gqa_group, hq) if causal else ():  # ragged: causal only
            run = partial(
                run_ragged_prefill, bench, hq, kv_heads, head_dim, args.seed, shapes.ragged
            )
            key = ("prefill", shapes.ragged["batch"], None, "ragged", hq, kv_heads, head_dim)
            measure("prefill", key, run)
        for s in shapes.prefill_sweep:
            run = partial(run_prefill_shape, bench, 1, s, hq, hkv, head_dim, causal)
            measure("prefill_sweep", ("prefill", 1, None, s, hq, hkv, head_dim), run)
    result["elapsed_s"] = time.time() - started
    if device.type == "cuda":
        result["peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
    if runner.broken:
        result.setdefault("notes", []).append(runner.broken)
    if any(row.get("partner") for row in result["rows"]):
        result["ab_threshold"] = report.AB_THRESHOLD
        result["ab"] = report.ab_comparison(result)
    files = report.write_outputs(result, args.out)
    print()
    print(report.render_markdown(result))
    print("wrote:", *files, sep="\n  ")
    print(f"command: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
