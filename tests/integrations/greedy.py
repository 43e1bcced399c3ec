"""Greedy generation through transformers for the integration tests: every prompt through
continuous batching (``generate_batch``), or each prompt alone through ``generate``. Import it
after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

from typing import List

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig


def random_prompts(vocab: int, lengths, seed: int = 11) -> List[List[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def generate_batch(model, implementation: str, prompts, steps: int, **batching) -> list:
    """Each prompt's greedy tokens (in the order of ``prompts``) through transformers'
    continuous batching; ``batching``: ContinuousBatchingConfig's arguments (block_size, ...)."""
    model.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=0)
    config.eos_token_id = None
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(**batching),
        progress_bar=False,
    )
    by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in outputs.values()}
    return [by_prompt[tuple(p)] for p in prompts]


def generate_each_prompt_alone(model, implementation: str, prompts, steps: int) -> list:
    model.set_attn_implementation(implementation)
    tokens = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens
