"""The main job: serve a batch of prompts of different lengths with a small decoder through
the paged KV cache (prefill, then decode steps) on every available backend, check that they
produce the same greedy tokens, and report tokens per second.

    python -m astrai.demo [--device cuda] [--steps 32] [--batch 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Dict, List

import torch

from astrai.extension import attn_backend, explain
from astrai.extension.backend.attention import _priority_backends
from astrai.models import DecoderConfig, TinyDecoder


def progress(label: str, done: int, total: int, show: bool = True) -> None:
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
    show: bool = True,
) -> Dict:
    device = model.lm_head.weight.device
    lengths = [len(p) for p in prompts]
    pages = sum((n + steps + page_size - 1) // page_size for n in lengths) + 1
    cache = model.make_cache(pages, page_size)
    seq_ids = list(range(len(prompts)))
    generated = [[] for _ in prompts]
    with attn_backend(backend):
        synchronize(device)
        start = time.perf_counter()
        cache.begin_step(seq_ids, lengths)
        tokens = torch.cat(prompts)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        decision = explain(
            torch.empty(
                1,
                len(tokens),
                model.config.num_heads,
                model.config.head_dim,
                dtype=cache.dtype,
                device=device,
            ),
            kv_cache=cache,
            fwd="prefill",
        )
        logits = model.step(tokens, positions, cache, "prefill")
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        next_tokens = logits[last].argmax(-1)
        progress(backend, 0, steps, show)
        for step in range(steps):
            for seq, token in enumerate(next_tokens.tolist()):
                generated[seq].append(token)
            if step == steps - 1:
                break
            cache.begin_step(seq_ids, [1] * len(prompts))
            positions = torch.tensor([n + step for n in lengths], device=device)
            logits = model.step(next_tokens, positions, cache, "decode")
            next_tokens = logits.argmax(-1)
            progress(backend, step + 1, steps, show)
        progress(backend, steps, steps, show)
        synchronize(device)
        seconds = time.perf_counter() - start
    processed = sum(lengths) + len(prompts) * (steps - 1)
    return {
        "tokens": generated,
        "seconds": seconds,
        "tokens_per_s": processed / seconds,
        "decided": decision.backend,
    }


@torch.no_grad()
def dense_agreement(model: TinyDecoder, prompts, generated) -> tuple:
    """Re-run each finished sequence densely (no cache) and count the greedy tokens that match:
    the paged prefill/decode path must compute what a full forward pass computes."""
    same = total = 0
    with attn_backend("torch_native"):
        for prompt, tokens in zip(prompts, generated):
            full = torch.cat([prompt, torch.tensor(tokens[:-1], device=prompt.device)])
            predicted = model(full[None])[0, len(prompt) - 1 :].argmax(-1).tolist()
            same += sum(a == b for a, b in zip(predicted, tokens))
            total += len(tokens)
    return same, total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
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
        generate(model, prompts, 2, name, args.page_size, show=False)  # warm-up: kernels, allocator
        results[name] = generate(model, prompts, args.steps, name, args.page_size)

    dense_same, dense_total = dense_agreement(model, prompts, results[backends[0]]["tokens"])
    reference = results[backends[-1]]["tokens"]
    print()
    print(
        f"{'backend':<14} {'ran':<14} {'tokens/s':>10} {'seconds':>8}  greedy tokens vs "
        f"{backends[-1]}"
    )
    all_match = True
    for name, result in results.items():
        same = sum(a == b for x, y in zip(result["tokens"], reference) for a, b in zip(x, y))
        total = sum(len(x) for x in reference)
        all_match &= same == total
        print(
            f"{name:<14} {result['decided']:<14} {result['tokens_per_s']:>10.0f} "
            f"{result['seconds']:>8.3f}  {same}/{total} identical"
        )
    print(
        f"{'dense recompute (no cache, torch_native)':<40} {dense_same}/{dense_total} identical "
        f"to {backends[0]}'s tokens"
    )
    all_match &= dense_same == dense_total
    print()
    print("sequence 0:", results[backends[0]]["tokens"][0][:16], "...")
    print("all backends agree" if all_match else "BACKENDS DISAGREE")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
