"""The main job: serve a batch of prompts of different lengths with a small decoder through
the paged KV cache (prefill, then decode steps) on every available backend, check that they
produce the same greedy tokens, and report tokens per second.

    python -m astrai.demo [--device cuda] [--steps 32] [--batch 6]

Agreement is checked teacher-forced: every backend is fed the reference backend's tokens, and
at each step its greedy choice must be the reference's, except where the reference itself
ranks the two tokens within --tie-tolerance of each other (a rounding-level near-tie, counted
and shown separately). A dense recompute without the cache is held to the same rule.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List, Optional

import torch

from astrai.extension import attn_backend, explain
from astrai.extension.backend.attention import _priority_backends
from astrai.models import DecoderConfig, TinyDecoder


def progress(label: str, done: int, total: int, show: bool) -> None:
    if not show:
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r  {label:<13} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model: TinyDecoder,
    prompts: List[torch.Tensor],
    steps: int,
    backend: str,
    page_size: int,
    forced: Optional[List[List[int]]] = None,
    show: bool = True,
) -> Dict:
    """Greedy generation (or, with ``forced``, teacher-forced steps) over a fresh paged cache.
    Returns the chosen tokens, each step's float32 logits ``[B, vocab]``, and the timing."""
    device = model.lm_head.weight.device
    lengths = [len(p) for p in prompts]
    pages = sum((n + steps + page_size - 1) // page_size for n in lengths) + 1
    cache = model.make_cache(pages, page_size)
    seq_ids = list(range(len(prompts)))
    tokens_out: List[List[int]] = [[] for _ in prompts]
    logits_out: List[torch.Tensor] = []
    with attn_backend(backend):
        synchronize(device)
        start = time.perf_counter()
        cache.begin_step(seq_ids, lengths)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        probe_q = torch.empty(
            1,
            sum(lengths),
            model.config.num_heads,
            model.config.head_dim,
            dtype=cache.dtype,
            device=device,
        )
        decided = explain(probe_q, kv_cache=cache, fwd="prefill").backend
        logits = model.step(torch.cat(prompts), positions, cache, "prefill")
        logits = logits[torch.tensor(lengths, device=device).cumsum(0) - 1]
        for step in range(steps):
            logits_out.append(logits.float().cpu())
            chosen = logits.argmax(-1)
            if forced is not None:
                chosen = torch.tensor([f[step] for f in forced], device=device)
            for seq, token in enumerate(chosen.tolist()):
                tokens_out[seq].append(token)
            progress(backend, step + 1, steps, show)
            if step == steps - 1:
                break
            cache.begin_step(seq_ids, [1] * len(prompts))
            positions = torch.tensor([n + step for n in lengths], device=device)
            logits = model.step(chosen, positions, cache, "decode")
        synchronize(device)
        seconds = time.perf_counter() - start
    processed = sum(lengths) + len(prompts) * (steps - 1)
    return {
        "tokens": tokens_out,
        "logits": logits_out,
        "seconds": seconds,
        "tokens_per_s": processed / seconds,
        "decided": decided,
    }


def agreement(predicted_logits: List[torch.Tensor], reference: Dict, tolerance: float):
    """(identical, near_ties, disagreements) of greedy choices against the reference's tokens."""
    same = ties = wrong = 0
    for step, logits in enumerate(predicted_logits):
        reference_logits = reference["logits"][step]
        for seq, row in enumerate(logits):
            want = reference["tokens"][seq][step]
            got = int(row.argmax())
            if got == want:
                same += 1
            elif reference_logits[seq, want] - reference_logits[seq, got] <= tolerance:
                ties += 1
            else:
                wrong += 1
    return same, ties, wrong


@torch.no_grad()
def dense_logits(model: TinyDecoder, prompts, reference) -> List[torch.Tensor]:
    """Each step's logits from a dense forward over prompt + reference tokens (no cache)."""
    steps = len(reference["tokens"][0])
    per_seq = []
    with attn_backend("torch_native"):
        for prompt, tokens in zip(prompts, reference["tokens"]):
            full = torch.cat([prompt, torch.tensor(tokens[:-1], device=prompt.device)])
            per_seq.append(model(full[None])[0, len(prompt) - 1 :].float().cpu())
    return [torch.stack([seq[step] for seq in per_seq]) for step in range(steps)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tie-tolerance",
        type=float,
        default=0.05,
        help="reference logit gap under which two tokens count as a near-tie",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    model = TinyDecoder(DecoderConfig()).to(device=device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(args.seed)
    prompt_lengths = [int(n) for n in torch.randint(5, 120, (args.batch,), generator=generator)]
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=generator).to(device)
        for n in prompt_lengths
    ]
    backends = [b.name for b in _priority_backends()]
    print(
        f"astrai demo: {model.config.num_layers}-layer decoder, GQA {model.config.num_heads}/"
        f"{model.config.num_kv_heads}, head_dim {model.config.head_dim}, {dtype}, {device}"
    )
    print(
        f"prompts: {prompt_lengths} tokens; {args.steps} greedy steps; page size "
        f"{args.page_size}; backends: {', '.join(backends)}"
    )

    results = {}
    for name in backends:
        generate(model, prompts, 2, name, args.page_size, show=False)  # warm-up
        results[name] = generate(model, prompts, args.steps, name, args.page_size)
    reference_name = backends[-1]
    reference = results[reference_name]

    print()
    print(
        f"{'backend':<14} {'ran':<14} {'tokens/s':>10} {'seconds':>8}   greedy choices, "
        f"teacher-forced on {reference_name}'s tokens"
    )
    failures = 0
    total = len(prompts) * args.steps
    rows = []
    for name in backends:
        forced = generate(
            model, prompts, args.steps, name, args.page_size, forced=reference["tokens"], show=False
        )
        rows.append(
            (name, results[name], agreement(forced["logits"], reference, args.tie_tolerance))
        )
    rows.append(
        (
            "dense, no cache",
            None,
            agreement(dense_logits(model, prompts, reference), reference, args.tie_tolerance),
        )
    )
    for name, result, (same, ties, wrong) in rows:
        failures += wrong
        timing = (
            f"{result['decided']:<14} {result['tokens_per_s']:>10.0f} {result['seconds']:>8.3f}"
            if result
            else f"{'torch_native':<14} {'':>10} {'':>8}"
        )
        print(
            f"{name:<14} {timing}   {same}/{total} identical, {ties} near-ties, "
            f"{wrong} disagreements"
        )
    print()
    print(f"sequence 0 ({reference_name}):", reference["tokens"][0][:16], "...")
    print("all backends agree" if failures == 0 else "BACKENDS DISAGREE")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
