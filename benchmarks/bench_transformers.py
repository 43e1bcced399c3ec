"""End-to-end transformers continuous batching: astrai's paged attention against transformers'
own, tokens per second of ``generate_batch`` on one model, one process.

    python3 benchmarks/bench_transformers.py                  # Llama-3-8B shape, 8 layers
    python3 benchmarks/bench_transformers.py --layers 32 --prompts 64 --new-tokens 256
    python3 benchmarks/bench_transformers.py --selftest       # no GPU: tiny model on the CPU

Implementations: ``paged|astrai`` (transformers' paged cache read and written in place by
astrai's paged op), transformers' own paged SDPA (``paged|sdpa`` up to transformers 5.18,
``sdpa`` after) and ``paged|flash_attention_2/3`` where the flash-attn packages import. Each
runs the same prompts with transformers' default continuous-batching settings for it (flash
gets transformers' decode fast path and CUDA graphs; SDPA and astrai do not), flash not
auto-switched in.

Model: Llama-3-8B's shape (hidden 4096, 32 query / 8 kv heads, head_dim 128, MLP 14336,
vocabulary 128256, rope theta 500000), ``--layers`` of its 32 layers, random bf16 weights.
Prompts: ``--prompts`` random prompts of 64 to 2048 tokens (log-uniform, fixed seed), each
generating exactly ``--new-tokens`` greedy tokens (no end-of-sequence token). Each
implementation runs once untimed on a few prompts, then ``--repeats`` timed runs; the best
counts. Tokens per second = generated tokens / wall seconds of the whole ``generate_batch``
(prefill included). The JSON also records each run's tokens and how many sequences produced
exactly the reference's greedy tokens (random weights give nearly flat logits: bf16 near-ties
fork sequences early, so this count is no correctness check; the tests and the demo are).

Outputs (under --out): bench_transformers_<gpu>_<date>.json and .md, with the command, GPU,
torch, CUDA, transformers and astrai versions.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the astrai of this checkout

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from astrai.integrations import transformers as astrai_transformers  # noqa: E402

SCRIPT = "benchmarks/bench_transformers.py"
LLAMA_3_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=1024,
)


def implementations() -> List[str]:
    names = [astrai_transformers.PAGED_NAME, astrai_transformers.TRANSFORMERS_PAGED]
    old = astrai_transformers.TRANSFORMERS_PAGED.startswith("paged|")
    for version, module in ((3, "flash_attn_interface"), (2, "flash_attn")):
        if torch.cuda.is_available() and importlib.util.find_spec(module) is not None:
            names.append(f"{'paged|' if old else ''}flash_attention_{version}")
    return names


def prompt_lengths(count: int, low: int, high: int, seed: int) -> List[int]:
    generator = torch.Generator().manual_seed(seed)
    logs = torch.empty(count).uniform_(math.log(low), math.log(high), generator=generator)
    return [int(x) for x in logs.exp().round()]


def cb_config(**overrides) -> ContinuousBatchingConfig:
    parameters = inspect.signature(ContinuousBatchingConfig).parameters
    if "auto_switch_to_flash" in parameters:
        overrides["auto_switch_to_flash"] = False  # measure the implementation asked for
    return ContinuousBatchingConfig(**overrides)


def run_once(
    model, implementation: str, prompts, new_tokens: int, show: bool, cache_overrides: Dict
) -> Dict:
    model.set_attn_implementation("sdpa")
    model.config._attn_implementation = implementation
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    config.eos_token_id = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=config,
        continuous_batching_config=cb_config(**cache_overrides),
        progress_bar=show,
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in outputs.values()}
    tokens = [by_prompt[tuple(p)] for p in prompts]
    generated = sum(len(t) for t in tokens)
    return {"seconds": seconds, "generated_tokens": generated, "tokens": tokens}


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> Dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    return {
        "gpu": gpu or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "transformers": transformers.__version__,
        "astrai_commit": git_commit(),
        "python": platform.python_version(),
    }


def cell(text: str) -> str:
    return str(text).replace("|", "\\|")  # "paged|astrai" inside a markdown table cell


def write_report(out_dir: str, result: Dict) -> str:
    env = result["environment"]
    stamp = datetime.date.today().isoformat()
    name = f"bench_transformers_{re.sub(r'[^A-Za-z0-9]+', '-', env['gpu']).strip('-')}_{stamp}"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as handle:
        json.dump(result, handle, indent=2)
    setup = result["setup"]
    reference = result["reference"]
    lines = [
        f"# transformers continuous batching: {env['gpu']}, {stamp}",
        "",
        f"`{result['command']}`",
        "",
        f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, transformers "
        f"{env['transformers']}, astrai {env['astrai_commit']}, Python {env['python']}.",
        "",
        f"Model: {setup['shape']}, {setup['layers']} layers, random {setup['dtype']} weights. "
        f"{setup['prompts']} prompts of {min(setup['prompt_lengths'])}-"
        f"{max(setup['prompt_lengths'])} tokens ({sum(setup['prompt_lengths'])} in all), "
        f"{setup['new_tokens']} new tokens each; best of {setup['repeats']} timed runs.",
        "",
        f"| implementation | tokens/s | seconds | vs {cell(reference)} |",
        "|---|---|---|---|",
    ]
    base = result["runs"].get(reference, {}).get("tokens_per_s")
    for implementation, run in result["runs"].items():
        if "error" in run:
            lines.append(f"| {cell(implementation)} | error: {cell(run['error'])} | | |")
            continue
        ratio = f"{run['tokens_per_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {cell(implementation)} | {run['tokens_per_s']:.0f} | {run['seconds']:.2f} | "
            f"{ratio} |"
        )
    lines += [
        "",
        "Random weights give nearly flat logits, so two bf16 implementations fork at near-ties "
        "early on; the JSON keeps each run's tokens and how many sequences match the reference "
        "exactly. Agreement is checked by the tests and `make demo`, not here.",
    ]
    with open(os.path.join(out_dir, name + ".md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return os.path.join(out_dir, name + ".md")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="of Llama-3-8B's 32")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--implementations", help="comma-separated; default: all available")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument(
        "--selftest", action="store_true", help="tiny model on the CPU: checks the script runs"
    )
    args = parser.parse_args(argv)
    command = "python3 " + " ".join([SCRIPT] + [shlex.quote(a) for a in (argv or sys.argv[1:])])

    astrai_transformers.register()
    if args.selftest:
        device, dtype, shape = torch.device("cpu"), torch.float32, TINY
        args.layers, args.prompts, args.new_tokens = 2, 6, 8
        args.min_prompt, args.max_prompt, args.repeats = 4, 40, 1
        if args.out == parser.get_default("out"):
            args.out = os.path.join(ROOT, "build", "bench_transformers_selftest")
    elif not torch.cuda.is_available():
        print("bench_transformers: needs a CUDA GPU (or --selftest)", file=sys.stderr)
        return 2
    else:
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, LLAMA_3_8B

    # transformers sizes the cache from free memory unless told; the selftest keeps it small.
    cache_overrides = dict(num_blocks=64, max_batch_tokens=64) if args.selftest else {}
    torch.manual_seed(args.seed)
    config = LlamaConfig(**shape, num_hidden_layers=args.layers)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    lengths = prompt_lengths(args.prompts, args.min_prompt, args.max_prompt, args.seed)
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = [
        torch.randint(1, config.vocab_size, (n,), generator=generator).tolist() for n in lengths
    ]
    names = args.implementations.split(",") if args.implementations else implementations()
    reference = astrai_transformers.TRANSFORMERS_PAGED
    print(
        f"bench_transformers: {args.layers}-layer Llama-3-8B shape, {args.prompts} prompts "
        f"({sum(lengths)} tokens), {args.new_tokens} new tokens each; {', '.join(names)}",
        file=sys.stderr,
    )

    runs: Dict[str, Dict] = {}
    for index, name in enumerate(names):
        print(f"[{index + 1}/{len(names)}] {name}", file=sys.stderr)
        try:
            run_once(model, name, prompts[:4], 4, False, cache_overrides)  # warm-up
            timed = [
                run_once(model, name, prompts, args.new_tokens, True, cache_overrides)
                for _ in range(args.repeats)
            ]
        except Exception as error:  # noqa: BLE001 - recorded, and the run goes on
            runs[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
            continue
        best = min(timed, key=lambda run: run["seconds"])
        runs[name] = {
            "seconds": best["seconds"],
            "all_seconds": [run["seconds"] for run in timed],
            "generated_tokens": best["generated_tokens"],
            "tokens_per_s": best["generated_tokens"] / best["seconds"],
            "tokens": best["tokens"],
        }
    for run in runs.values():
        if "tokens" in run and "tokens" in runs.get(reference, {}):
            run["identical_sequences"] = sum(
                a == b for a, b in zip(run["tokens"], runs[reference]["tokens"])
            )
        elif "tokens" in run:
            run["identical_sequences"] = "n/a"

    result = {
        "command": command,
        "environment": environment(),
        "setup": {
            "layers": args.layers,
            "prompts": args.prompts,
            "prompt_lengths": lengths,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "dtype": str(dtype).replace("torch.", ""),
            "model": {**shape, "num_hidden_layers": args.layers},
            "shape": "tiny (selftest)" if args.selftest else "Llama-3-8B shape",
        },
        "reference": reference,
        "runs": runs,
    }
    report = write_report(args.out, result)
    print(open(report).read())
    print(f"written: {report} (and .json)", file=sys.stderr)
    failed = [name for name, run in runs.items() if "error" in run]
    return 1 if failed and len(failed) == len(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
