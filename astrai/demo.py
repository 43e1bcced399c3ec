"""The main job: serve a Hugging Face transformers model (a small Llama-architecture config,
random weights, nothing downloaded) through astrai on every available backend, against
transformers' own attention, and check that they choose the same greedy tokens.

    python -m astrai.demo [--device cuda] [--prompts 16] [--new-tokens 32]

On a GPU the batch is served with transformers' continuous batching (``generate_batch``):
``"paged|astrai"`` writes and reads transformers' own paged cache in place through astrai's
paged op. On a CPU it is a left-padded batch through ``generate`` (transformers' own cache,
``"astrai"``). Tokens per second count generated tokens over the whole run (prefill
included), best of --repeats runs.

Agreement: each backend's greedy tokens must be transformers' own. Where a sequence first
differs, a float32 copy of the model must rank the two tokens closer than --tie-slack times the
error of the model's own logits there (transformers' SDPA in bf16 against float32): a near-tie
that rounding can flip either way, counted and shown separately. The rest of that sequence is
not compared, since it continues from another token.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

try:
    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, StoppingCriteria
except ImportError:  # pragma: no cover - make demo installs it
    sys.exit("astrai demo: needs transformers (pip install 'transformers>=5.17,<5.26')")

from astrai.extension import attn_backend
from astrai.extension.backend.attention import _priority_backends
from astrai.extension.kv_cache import tokens_that_fit
from astrai.integrations import transformers as astrai_transformers


@dataclass
class Run:
    label: str  # what ran, for the table
    tokens: List[List[int]]  # greedy tokens per prompt
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


def build_model(device: torch.device) -> LlamaForCausalLM:
    if device.type == "cuda":  # head_dim 128: astrai's cuda kernels serve 64, 128 and 256
        shape = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, head_dim=128)
        shape.update(num_hidden_layers=8, intermediate_size=5632, vocab_size=8192)
        dtype = torch.bfloat16
    else:
        shape = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
        shape.update(num_hidden_layers=4, intermediate_size=512, vocab_size=1024)
        dtype = torch.float32
    # A wide initialisation keeps the top logits apart by far more than bf16 rounding.
    config = LlamaConfig(**shape, max_position_embeddings=4096, initializer_range=0.1)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


class Progress(StoppingCriteria):
    """A progress bar on stderr, one tick per generated token of ``generate``."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done = label, total, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(
            f"\r  {self.label:<28} [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_config(new_tokens: int) -> GenerationConfig:
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    config.eos_token_id = None  # random weights: run every sequence to its length
    return config


@torch.no_grad()
def dense_generate(model, implementation, prompts, new_tokens, label, show=True) -> Run:
    """A left-padded batch through ``generate`` with transformers' own cache."""
    device = model.device
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    model.set_attn_implementation(implementation)
    criteria = [Progress(label, new_tokens)] if show else []
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        generation_config=greedy_config(new_tokens),
        stopping_criteria=criteria,
    )
    synchronize(device)
    seconds = time.perf_counter() - start
    return Run(label, out[:, longest:].tolist(), seconds)


@torch.no_grad()
def batched_generate(model, implementation, prompts, new_tokens, label, show=True) -> Run:
    """The prompts through transformers' continuous batching (``generate_batch``)."""
    device = model.device
    model.set_attn_implementation("sdpa")
    model.config._attn_implementation = implementation
    if show:
        sys.stderr.write(f"  {label}\n")
    synchronize(device)
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts, generation_config=greedy_config(new_tokens), progress_bar=show
    )
    synchronize(device)
    seconds = time.perf_counter() - start
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in outputs.values()}
    return Run(label, [by_prompt[tuple(p)] for p in prompts], seconds)


def float32_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    if model.dtype == torch.float32:
        return model
    exact = LlamaForCausalLM(model.config).to(model.device).float().eval()
    exact.load_state_dict({name: w.float() for name, w in model.state_dict().items()})
    return exact


@torch.no_grad()
def agreement(model, exact, prompts, reference: Run, run: Run, slack: float):
    """(identical tokens, near-ties, disagreements, tokens compared) against the reference.
    ``exact``: a float32 copy of the model. Where a sequence first differs, the two tokens are a
    near-tie when the float32 copy ranks them closer than ``slack`` times the error of the
    model's own logits there (transformers' SDPA in the model's dtype against float32): a gap
    that rounding can flip either way."""
    exact.set_attn_implementation("sdpa")
    model.set_attn_implementation("sdpa")
    identical = ties = wrong = compared = 0
    for prompt, want, got in zip(prompts, reference.tokens, run.tokens):
        for step, (a, b) in enumerate(zip(want, got)):
            compared += 1
            if a == b:
                identical += 1
                continue
            prefix = torch.tensor([prompt + want[:step]], device=exact.device)
            logits = exact(prefix).logits[0, -1].float()
            error = (model(prefix).logits[0, -1].float() - logits).abs().max()
            if (logits[a] - logits[b]).abs() <= slack * error:
                ties += 1
            else:
                wrong += 1
            break  # the sequences continue from different tokens
    return identical, ties, wrong, compared


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=None, help="default: 64 GPU, 8 CPU")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 GPU, 16 CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs each; the best counts")
    parser.add_argument(
        "--tie-slack",
        type=float,
        default=2.0,
        help="a near-tie: the float32 gap between two tokens is under this many times the "
        "model's own logit error at that step",
    )
    parser.add_argument(
        "--mla", action="store_true", help="serve a tiny DeepSeek-V3 over astrai's latent cache"
    )
    args = parser.parse_args(argv)
    if args.mla:  # astrai/integrations/deepseek_mla.py: latent cache, bytes per token, agreement
        from astrai.integrations import deepseek_mla

        return deepseek_mla.demo(args.device, args.prompts or 4, args.new_tokens or 8, args.seed)

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    num_prompts = args.prompts or (64 if on_gpu else 8)
    new_tokens = args.new_tokens or (128 if on_gpu else 16)
    astrai_transformers.register()
    torch.manual_seed(args.seed)
    model = build_model(device)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    lengths = torch.randint(4, 400 if on_gpu else 48, (num_prompts,), generator=generator)
    prompts = [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in lengths]
    config = model.config
    cache_shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    print(
        f"astrai demo: transformers {transformers.__version__} Llama, {config.num_hidden_layers} "
        f"layers, GQA {config.num_attention_heads}/{config.num_key_value_heads}, head_dim "
        f"{config.head_dim}, {model.dtype}, {device} (random weights)"
    )

    memory = 1 << 30
    fits = [
        f"{str(dtype).replace('torch.', '')} {tokens_that_fit(memory, *cache_shape, dtype):,}"
        for dtype in (model.dtype, torch.float8_e4m3fn)
    ]
    print(f"tokens whose K and V (every layer) fit in 1 GiB of KV cache: {', '.join(fits)}")

    if on_gpu:
        generate = batched_generate
        ours, theirs = astrai_transformers.PAGED_NAME, astrai_transformers.TRANSFORMERS_PAGED
        how = "continuous batching (generate_batch, transformers' paged cache)"
    else:
        generate = dense_generate
        ours, theirs = astrai_transformers.NAME, "sdpa"
        how = "generate, left-padded batch (transformers' cache)"
    print(
        f"{num_prompts} prompts of {int(lengths.min())}-{int(lengths.max())} tokens, "
        f"{new_tokens} new tokens each; {how}"
    )

    backends = [b.name for b in _priority_backends()]
    plan = [(f"transformers '{theirs}'", theirs, None)]
    plan += [(f"astrai '{ours}', {name}", ours, name) for name in backends]
    runs: Dict[str, Run] = {}
    failed: Dict[str, str] = {}
    for index, (label, implementation, backend) in enumerate(plan):
        print(f"[{index + 1}/{len(plan)}] {label}", file=sys.stderr)
        try:
            with attn_backend(backend) if backend else contextlib.nullcontext():
                generate(model, implementation, prompts[:2], 2, label, show=False)  # warm-up
                timed = [
                    generate(model, implementation, prompts, new_tokens, label, show=repeat == 0)
                    for repeat in range(args.repeats)
                ]
                runs[label] = min(timed, key=lambda run: run.seconds)
        except RuntimeError as error:  # a strict backend that cannot serve these calls
            failed[label] = str(error).splitlines()[0]

    reference = runs[plan[0][0]]
    exact = float32_copy(model)
    print()
    print(
        f"{'implementation':<34} {'tokens/s':>10} {'seconds':>8} {'vs transformers':>16}   "
        "greedy tokens vs transformers'"
    )
    disagreements = 0
    for label, _, _ in plan:
        if label in failed:
            print(f"{label:<34} cannot run here: {failed[label]}")
            continue
        run = runs[label]
        speed = run.tokens_per_s / reference.tokens_per_s
        if run is reference:
            check = "(reference)"
        else:
            same, ties, wrong, compared = agreement(
                model, exact, prompts, reference, run, args.tie_slack
            )
            disagreements += wrong
            check = f"{same}/{compared} identical, {ties} near-ties, {wrong} disagreements"
        print(
            f"{label:<34} {run.tokens_per_s:>10.0f} {run.seconds:>8.2f} {speed:>15.2f}x   {check}"
        )
    print()
    print(f"prompt 0, first tokens: {reference.tokens[0][:12]}")
    if disagreements or len(failed) == len(plan) - 1:
        print("ASTRAI AND TRANSFORMERS DISAGREE" if disagreements else "NO ASTRAI BACKEND RAN")
        return 1
    print("astrai and transformers agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
