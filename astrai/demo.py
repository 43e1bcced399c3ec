"""The main job: serve a Hugging Face transformers model through astrai on every available
backend, against transformers' own attention, and check that they choose the same greedy
tokens. The model is a small Llama-architecture config with random weights (nothing is
downloaded), or a local checkpoint (--model PATH).

    python -m astrai.demo [--device cuda] [--paged] [--prompts 16] [--new-tokens 32]

On a GPU, and with --paged anywhere, the batch is served with transformers' continuous batching
(``generate_batch``): ``"paged|astrai"`` writes and reads transformers' own paged cache in place
through astrai's paged op (cuda kernels on a GPU, torch_native on a CPU). Otherwise it is a
left-padded batch through ``generate`` (transformers' own cache, ``"astrai"``). Speed: generated
tokens per second over the whole run (prefill included), the median of --repeats timed runs with
their range; the ratio to transformers compares medians. On a CPU the toy model's timings are
dominated by Python overhead: read them as a smoke test, not a benchmark.

Agreement: each backend's greedy tokens must be transformers' own. Where a sequence first
differs, a float32 copy of the model must rank the two tokens closer than --tie-slack times the
error of the model's own logits there (transformers' SDPA in the model's dtype against float32):
a near-tie that rounding can flip either way, counted and shown separately. The rest of that
sequence is not compared, since it continues from another token.
"""

# Only argparse is imported before the arguments are parsed: --help answers at once, and torch
# and transformers (seconds to import) load only for a run.
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

TESTED_TRANSFORMERS = "transformers>=5.17,<5.26"


@dataclass
class Run:
    label: str  # what ran, for the table
    tokens: List[List[int]]  # greedy tokens per prompt
    seconds: List[float]  # each timed run

    @property
    def rates(self) -> List[float]:
        generated = sum(len(t) for t in self.tokens)
        return sorted(generated / s for s in self.seconds)

    @property
    def median_rate(self) -> float:
        rates = self.rates
        middle = len(rates) // 2
        return rates[middle] if len(rates) % 2 else (rates[middle - 1] + rates[middle]) / 2


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    description, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m astrai.demo",
        description=" ".join(description.split()),
        epilog=details.split("\n\n", 1)[1] if "\n\n" in details else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None, help="default: cuda where a GPU is visible")
    parser.add_argument(
        "--paged",
        action="store_true",
        help="continuous batching through 'paged|astrai' also on a CPU (always on a GPU)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local transformers checkpoint (a folder with config.json and weights) instead of "
        "the random Llama; loaded with local_files_only, nothing is downloaded",
    )
    parser.add_argument("--prompts", type=int, default=None, help="default: 64 GPU, 8 CPU")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 GPU, 16 CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs each; the table shows their median"
    )
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
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    try:
        import transformers
    except ImportError:
        sys.exit(f"astrai demo: needs transformers (pip install '{TESTED_TRANSFORMERS}')")
    if args.mla:  # astrai/integrations/deepseek_mla.py: latent cache, bytes per token, agreement
        from astrai.integrations import deepseek_mla

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return deepseek_mla.demo(device, args.prompts or 4, args.new_tokens or 8, args.seed)
    return Demo(args, torch, transformers).run()


class Demo:
    def __init__(self, args, torch, transformers):
        self.args, self.torch, self.transformers = args, torch, transformers
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.on_gpu = self.device.type == "cuda"
        self.paged = self.on_gpu or args.paged

    # -- the model -------------------------------------------------------------------------
    def build_model(self):
        torch, transformers = self.torch, self.transformers
        if self.args.model:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                self.args.model,
                dtype=torch.bfloat16 if self.on_gpu else torch.float32,
                local_files_only=True,
            )
            return model.to(self.device).eval()
        if self.on_gpu:  # head_dim 128: astrai's cuda kernels serve 64, 96, 128, 256 and 512
            shape = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4)
            shape.update(head_dim=128, num_hidden_layers=8, intermediate_size=5632)
            shape.update(vocab_size=8192)
            dtype = torch.bfloat16
        else:
            shape = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
            shape.update(head_dim=32, num_hidden_layers=4, intermediate_size=512, vocab_size=1024)
            dtype = torch.float32
        # A wide initialisation keeps the top logits apart by far more than bf16 rounding.
        config = transformers.LlamaConfig(
            **shape, max_position_embeddings=4096, initializer_range=0.1
        )
        return transformers.LlamaForCausalLM(config).to(device=self.device, dtype=dtype).eval()

    def float32_copy(self, model):
        if model.dtype == self.torch.float32:
            return model
        exact = type(model)(model.config).to(self.device).float().eval()
        exact.load_state_dict({name: w.float() for name, w in model.state_dict().items()})
        return exact

    def synchronize(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize(self.device)

    def greedy_config(self, new_tokens: int):
        config = self.transformers.GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        config.eos_token_id = None  # random weights: run every sequence to its length
        return config

    # -- the two ways of serving ---------------------------------------------------------------
    def dense_generate(self, model, implementation, prompts, new_tokens, label, show):
        """A left-padded batch through ``generate`` with transformers' own cache."""
        torch = self.torch
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        model.set_attn_implementation(implementation)
        progress = _tqdm_ticks(self.transformers, label, new_tokens, show)
        self.synchronize()
        start = _now()
        with torch.no_grad():
            out = model.generate(
                ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=self.greedy_config(new_tokens),
                stopping_criteria=[progress] if progress else [],
            )
        self.synchronize()
        seconds = _now() - start
        if progress:
            progress.close()
        return out[:, longest:].tolist(), seconds

    def batched_generate(self, model, implementation, prompts, new_tokens, label, show):
        """The prompts through transformers' continuous batching (``generate_batch``, whose
        progress bar is tqdm's)."""
        model.set_attn_implementation("sdpa")
        model.config._attn_implementation = implementation
        if show:
            print(f"  {label}", file=sys.stderr)
        self.synchronize()
        start = _now()
        config = self.greedy_config(new_tokens)
        config.eos_token_id = -1  # what continuous batching takes for "none" (else it warns)
        with self.torch.no_grad():
            outputs = model.generate_batch(
                inputs=prompts,
                generation_config=config,
                progress_bar=show and sys.stderr.isatty(),  # its tqdm redraws even into files
            )
        self.synchronize()
        seconds = _now() - start
        by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in outputs.values()}
        return [by_prompt[tuple(p)] for p in prompts], seconds

    # -- agreement ---------------------------------------------------------------------------
    def agreement(self, model, exact, prompts, reference: Run, run: Run):
        """(identical tokens, near-ties, disagreements, tokens compared) against the reference
        (module docstring)."""
        torch = self.torch
        exact.set_attn_implementation("sdpa")
        model.set_attn_implementation("sdpa")
        identical = ties = wrong = compared = 0
        with torch.no_grad():
            for prompt, want, got in zip(prompts, reference.tokens, run.tokens):
                for step, (a, b) in enumerate(zip(want, got)):
                    compared += 1
                    if a == b:
                        identical += 1
                        continue
                    prefix = torch.tensor([prompt + want[:step]], device=exact.device)
                    logits = exact(prefix).logits[0, -1].float()
                    error = (model(prefix).logits[0, -1].float() - logits).abs().max()
                    if (logits[a] - logits[b]).abs() <= self.args.tie_slack * error:
                        ties += 1
                    else:
                        wrong += 1
                    break  # the sequences continue from different tokens
        return identical, ties, wrong, compared

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> int:
        torch, args = self.torch, self.args
        from astrai import attn_backend, tokens_that_fit
        from astrai.extension.backend.attention import _priority_backends
        from astrai.integrations import transformers as astrai_transformers

        num_prompts = args.prompts or (64 if self.on_gpu else 8)
        new_tokens = args.new_tokens or (128 if self.on_gpu else 16)
        astrai_transformers.register()
        torch.manual_seed(args.seed)
        model = self.build_model()
        config = model.config
        generator = torch.Generator().manual_seed(args.seed)
        lengths = torch.randint(4, 400 if self.on_gpu else 48, (num_prompts,), generator=generator)
        vocab = config.vocab_size
        prompts = [
            torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in lengths
        ]
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        what = args.model or "Llama (random weights)"
        print(
            f"astrai demo: transformers {self.transformers.__version__}, {what}, "
            f"{config.num_hidden_layers} layers, GQA {config.num_attention_heads}/"
            f"{config.num_key_value_heads}, head_dim {head_dim}, {model.dtype}, {self.device}"
        )
        cache_shape = (config.num_hidden_layers, config.num_key_value_heads, head_dim)
        fits = [
            f"{str(dtype).replace('torch.', '')} {tokens_that_fit(1 << 30, *cache_shape, dtype):,}"
            for dtype in (model.dtype, torch.float8_e4m3fn)
        ]
        print(f"tokens whose K and V (every layer) fit in 1 GiB of KV cache: {', '.join(fits)}")

        if self.paged:
            generate = self.batched_generate
            ours, theirs = astrai_transformers.PAGED_NAME, astrai_transformers.TRANSFORMERS_PAGED
            how = "continuous batching (generate_batch, transformers' paged cache)"
        else:
            generate = self.dense_generate
            ours, theirs = astrai_transformers.NAME, "sdpa"
            how = "generate, left-padded batch (transformers' cache); --paged: continuous batching"
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
                with attn_backend(backend) if backend else _nothing():
                    generate(model, implementation, prompts[:2], 2, label, False)  # warm-up
                    tokens, seconds = None, []
                    for repeat in range(args.repeats):
                        got, took = generate(
                            model, implementation, prompts, new_tokens, label, repeat == 0
                        )
                        tokens = tokens or got
                        seconds.append(took)
                    runs[label] = Run(label, tokens, seconds)
            except RuntimeError as error:  # a strict backend that cannot serve these calls
                failed[label] = str(error).splitlines()[0]

        reference = runs[plan[0][0]]
        exact = self.float32_copy(model)
        print()
        print(
            f"{'implementation':<34} {'tokens/s (median, range)':>26} {'vs transformers':>16}   "
            "greedy tokens vs transformers'"
        )
        disagreements = 0
        for label, _, _ in plan:
            if label in failed:
                print(f"{label:<34} cannot run here: {failed[label]}")
                continue
            run = runs[label]
            rates = run.rates
            speed = f"{run.median_rate:.0f} ({rates[0]:.0f}-{rates[-1]:.0f})"
            ratio = run.median_rate / reference.median_rate
            if run is reference:
                check = "(reference)"
            else:
                same, ties, wrong, compared = self.agreement(model, exact, prompts, reference, run)
                disagreements += wrong
                check = f"{same}/{compared} identical, {ties} near-ties, {wrong} disagreements"
            print(f"{label:<34} {speed:>26} {ratio:>15.2f}x   {check}")
        print(f"(median of {args.repeats} timed runs each, after a warm-up)")
        if not self.on_gpu:
            print("(CPU: a toy model, timings dominated by Python overhead; not a benchmark)")
        print()
        print(f"prompt 0, first tokens: {reference.tokens[0][:12]}")
        if disagreements or len(failed) == len(plan) - 1:
            print("ASTRAI AND TRANSFORMERS DISAGREE" if disagreements else "NO ASTRAI BACKEND RAN")
            return 1
        print("astrai and transformers agree")
        return 0


def _now() -> float:
    import time

    return time.perf_counter()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return False


def _tqdm_ticks(transformers, label: str, total: int, show: bool):
    """A transformers stopping criterion that ticks a tqdm bar once per generated token (on a
    terminal; tqdm stays silent where stderr is a file or a pipe), or None."""
    if not show:
        return None
    import torch
    from tqdm.auto import tqdm

    class Ticks(transformers.StoppingCriteria):
        def __init__(self):
            self.bar = tqdm(total=total, desc=f"  {label}", unit="tok", leave=False, disable=None)

        def __call__(self, input_ids, scores, **kwargs):
            self.bar.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        def close(self):
            self.bar.close()

    return Ticks()


if __name__ == "__main__":
    sys.exit(main())
