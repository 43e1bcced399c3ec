"""Serving a transformers DeepSeek-V3-architecture model (DeepSeek V3/R1, Kimi K2: transformers'
``DeepseekV3ForCausalLM``) through astrai's latent attention over a paged latent cache.

transformers' ``DeepseekV3Attention`` caches each token's latent and rotary key, then expands
every cached latent into per-head keys and values (``kv_b_proj``) on every step, and its
continuous batching caches the expanded heads. Here each layer's attention is replaced, while
serving, by ``LatentAttention``, which keeps the latent form throughout:

- it caches the layer's latent ``c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:Dc])`` and rotary key
  ``k_rope`` (rope applied) in a ``PagedLatentCache`` (``Dc + Dr`` = 576 values a token per
  layer, against ``H * (dn + dr + dv)`` for the decompressed heads: 71x fewer for DeepSeek-V3);
- it absorbs the up-projections. With ``kv_b_proj.weight`` viewed as ``[H, dn + dv, Dc]``,
  ``W_UK[h] = W[h, :dn]`` and ``W_UV[h] = W[h, dn:]``, the key of head h is ``W_UK[h] c`` and its
  value ``W_UV[h] c``, so ``q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c`` and
  ``sum_j p_j W_UV[h] c_j = W_UV[h] sum_j p_j c_j``: ``mla_attention`` runs over the latent with
  the query ``W_UK[h]^T q_nope[h]`` (``[T, H, Dc]``), and its output ``[T, H, Dc]`` is multiplied
  by ``W_UV[h]`` before ``o_proj``. The rope part and the softmax scale (``module.scaling``:
  ``qk_head_dim ** -0.5`` times yarn's ``mscale^2``) are the model's own.

``generate`` serves a batch of prompts greedily this way: one packed prefill step (through
``mla_attention``'s prefill; the decompressed prefill is another issue's), then decode steps, each
step's tokens packed into one row so that positions, not padding, tell the sequences apart.
``cache_bytes_per_token`` compares the two caches; ``demo`` (``python -m astrai.demo --mla``)
serves a tiny random model both ways and compares their greedy tokens.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from astrai.extension.latent_cache import PagedLatentCache
from astrai.extension.selection import BackendSpec
from astrai.integrations.transformers import NO_MEANING_FOR_ATTENTION

try:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )
except ImportError as error:  # pragma: no cover - transformers is an optional dependency
    raise ImportError(
        "astrai.integrations.deepseek_mla needs transformers with DeepSeek-V3 "
        "(pip install 'transformers>=5.17,<5.26')"
    ) from error


def _check_kwargs(kwargs: Dict[str, object]) -> None:
    """Every keyword the decoder layer passes on is one with no meaning for attention
    (astrai.integrations.transformers lists them), or raises naming it: none is dropped."""
    for name in kwargs:
        if name not in NO_MEANING_FOR_ATTENTION:
            raise NotImplementedError(
                f"{name}: the decoder layer passed this keyword to LatentAttention, which does "
                "not implement it (it would be silently ignored)"
            )


class LatentAttention(nn.Module):
    """One ``DeepseekV3Attention`` served over a latent cache (module docstring): the same
    weights (the module is kept, not copied), the latent form throughout. ``serving`` holds the
    cache and the backend of the step being run."""

    def __init__(self, attention: DeepseekV3Attention, serving: LatentServing):
        super().__init__()
        self.attention = attention
        self.serving = serving
        heads, nope, v_dim = attention.num_heads, attention.qk_nope_head_dim, attention.v_head_dim
        up = attention.kv_b_proj.weight.view(heads, nope + v_dim, attention.kv_lora_rank)
        self.key_up = up[:, :nope]  # W_UK [H, dn, Dc]: views of kv_b_proj's weight
        self.value_up = up[:, nope:]  # W_UV [H, dv, Dc]

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs
    ):
        # attention_mask: built by the model from no mask of the caller's (latent_attention's
        # hook refuses one), so it says nothing the step's per-sequence causal placement does not.
        if cache is not None:
            raise NotImplementedError(
                "cache: LatentAttention keeps each layer's latent in the PagedLatentCache it "
                "serves; a transformers cache beside it would not be updated (call the model "
                "with use_cache=False)"
            )
        _check_kwargs(kwargs)
        a = self.attention
        cache = self.serving.cache
        batch, tokens = hidden_states.shape[:2]
        if batch != 1:
            raise ValueError(
                f"hidden_states: LatentAttention serves one packed row of a step's tokens, got "
                f"a batch of {batch}"
            )
        x = hidden_states[0]  # [T, hidden]
        if a.q_lora_rank is None:
            q = a.q_proj(x)
        else:
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
        q = q.view(tokens, a.num_heads, a.qk_head_dim)
        q_nope, q_rope = torch.split(q, [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rope = torch.split(
            a.kv_a_proj_with_mqa(x), [a.kv_lora_rank, a.qk_rope_head_dim], dim=-1
        )
        latent = a.kv_a_layernorm(latent)  # [T, Dc]
        # The model's rotary embedding, in its layout: [1, heads, T, Dr] and [1, 1, T, Dr].
        cos, sin = position_embeddings
        rotate = (
            apply_rotary_pos_emb_interleave if a.config.rope_interleave else apply_rotary_pos_emb
        )
        q_rope, k_rope = rotate(
            q_rope.transpose(0, 1)[None], k_rope.view(1, 1, tokens, -1), cos, sin
        )
        q_rope = q_rope[0].transpose(0, 1)  # [T, H, Dr]
        k_rope = k_rope.view(tokens, -1)  # [T, Dr]

        layer = a.layer_idx
        if cache.is_fp8 and layer not in self.serving.scaled_layers:
            cache.scale_from(layer, latent)  # the first prefill's latents set the layer's scale
            self.serving.scaled_layers.add(layer)
        cache.append(layer, latent, k_rope)
        absorbed = torch.einsum("thn,hnc->thc", q_nope, self.key_up)  # W_UK^T q_nope: [T, H, Dc]
        out = cache.attention(
            layer,
            absorbed.contiguous(),
            q_rope.contiguous(),
            a.scaling,
            backend=self.serving.backend,
        )  # [T, H, Dc]
        out = torch.einsum("thc,hvc->thv", out, self.value_up)  # W_UV out: [T, H, dv]
        return a.o_proj(out.reshape(1, tokens, a.num_heads * a.v_head_dim)), None


class LatentServing:
    """What the ``LatentAttention`` modules of one model share while serving: the cache, the
    backend (None: the usual selection), the layers whose FP8 scale is set."""

    def __init__(self, cache: PagedLatentCache, backend: BackendSpec = None):
        self.cache = cache
        self.backend = backend
        self.scaled_layers: set = set()


@contextlib.contextmanager
def latent_attention(
    model: DeepseekV3ForCausalLM, cache: PagedLatentCache, backend: BackendSpec = None
) -> Iterator[LatentServing]:
    """Inside the block, every attention module of ``model`` serves over ``cache``
    (``LatentAttention``); the model's own modules are back on exit."""
    layers = model.model.layers
    originals = [layer.self_attn for layer in layers]
    for attention in originals:
        if not isinstance(attention, DeepseekV3Attention):
            raise TypeError(
                f"model: expected DeepseekV3Attention modules (a DeepSeek-V3-architecture "
                f"model), got {type(attention).__name__}"
            )
    config = model.config
    if (
        cache.num_layers < len(layers)
        or cache.latent_dim != config.kv_lora_rank
        or (cache.rope_dim != config.qk_rope_head_dim)
    ):
        raise ValueError(
            f"cache: {cache.num_layers} layers of latent {cache.latent_dim} and rope "
            f"{cache.rope_dim}, the model needs {len(layers)} of {config.kv_lora_rank} and "
            f"{config.qk_rope_head_dim}"
        )
    serving = LatentServing(cache, backend)
    hook = model.model.register_forward_pre_hook(_refuse_a_callers_mask, with_kwargs=True)
    try:
        for layer, attention in zip(layers, originals):
            layer.self_attn = LatentAttention(attention, serving)
        yield serving
    finally:
        hook.remove()
        for layer, attention in zip(layers, originals):
            layer.self_attn = attention


def _refuse_a_callers_mask(module, args, kwargs):
    """A caller's ``attention_mask`` (padding, say) is refused, not ignored: the cache's step
    (``begin_step``) is what tells the packed row's sequences apart."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is not None:
        raise NotImplementedError(
            "attention_mask: LatentAttention does not read a mask; each token's sequence and "
            "causal place come from the latent cache's begin_step (pack the sequences into one "
            "row, without padding, and pass attention_mask=None)"
        )


def latent_cache_for(
    model: DeepseekV3ForCausalLM,
    num_pages: int,
    page_size: int = 64,
    latent_dtype: Optional[torch.dtype] = None,
) -> PagedLatentCache:
    """A ``PagedLatentCache`` shaped for ``model`` (its layers, latent and rope dims, dtype and
    device); ``latent_dtype=torch.float8_e4m3fn`` for an FP8 latent."""
    config = model.config
    return PagedLatentCache(
        config.num_hidden_layers,
        num_pages,
        page_size,
        latent_dim=config.kv_lora_rank,
        rope_dim=config.qk_rope_head_dim,
        dtype=model.dtype,
        device=model.device,
        latent_dtype=latent_dtype,
    )


@torch.no_grad()
def generate(
    model: DeepseekV3ForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    page_size: int = 64,
    latent_dtype: Optional[torch.dtype] = None,
    backend: BackendSpec = None,
) -> List[List[int]]:
    """Greedy tokens of each prompt (``max_new_tokens`` each), served over a latent paged cache:
    one packed prefill step, then one decode step per token."""
    if max_new_tokens < 1 or not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts, max_new_tokens: expected non-empty prompts and >= 1 new token")
    device = model.device
    lengths = [len(p) for p in prompts]
    longest = max(lengths) + max_new_tokens
    pages_per_seq = -(-longest // page_size)
    cache = latent_cache_for(model, len(prompts) * pages_per_seq, page_size, latent_dtype)
    seq_ids = list(range(len(prompts)))
    generated: List[List[int]] = [[] for _ in prompts]
    with latent_attention(model, cache, backend):
        ids = torch.tensor([t for p in prompts for t in p], device=device)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        last = torch.tensor(lengths).cumsum(0).to(device) - 1  # each prompt's last token
        cache.begin_step(seq_ids, lengths)
        for step in range(max_new_tokens):
            logits = model(
                input_ids=ids[None],
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=last,
            ).logits[0]
            chosen = logits.argmax(-1)  # [B]
            for b, token in enumerate(chosen.tolist()):
                generated[b].append(token)
            if step + 1 == max_new_tokens:
                break
            ids = chosen
            positions = torch.tensor([cache.seq_len(s) for s in seq_ids], device=device)
            last = torch.arange(len(prompts), device=device)
            cache.begin_step(seq_ids, [1] * len(prompts), block_table_width=pages_per_seq)
    return generated


def cache_bytes_per_token(
    config: DeepseekV3Config,
    dtype: torch.dtype = torch.bfloat16,
    latent_dtype: Optional[torch.dtype] = None,
) -> Dict[str, int]:
    """Bytes one token takes over every layer: ``latent`` (the latent and rotary key, the latent
    in ``latent_dtype``, else ``dtype``) and ``decompressed`` (every head's key, dn + dr, and
    value, dv, in ``dtype``: what transformers' continuous batching caches)."""
    element = torch.empty((), dtype=dtype).element_size()
    latent_element = torch.empty((), dtype=latent_dtype or dtype).element_size()
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return {
        "latent": layers
        * (config.kv_lora_rank * latent_element + config.qk_rope_head_dim * element),
        "decompressed": layers * heads * head * element,
    }


# -- tiny configs and the demo -----------------------------------------------------------------

# Tiny random configs of the two architectures the issue names (nothing downloaded). Their
# latent and rope dims are the real ones (512 and 64: what the cuda kernel takes); heads, experts,
# widths and layers are small. Kimi K2 is DeepSeek-V3's architecture with 64 heads, 384 experts in
# one group, yarn factor 32 and one dense layer.
TINY_CONFIGS = {
    "deepseek-v3": dict(
        num_attention_heads=16,
        max_position_embeddings=128 * 40,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=128,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    "kimi-k2": dict(
        num_attention_heads=16,
        max_position_embeddings=128 * 32,
        n_routed_experts=12,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50000.0,
            factor=32.0,
            original_max_position_embeddings=128,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}


def tiny_config(name: str = "deepseek-v3", **overrides) -> DeepseekV3Config:
    """A tiny random ``DeepseekV3Config`` of ``TINY_CONFIGS[name]``."""
    values = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        kv_lora_rank=512,
        q_lora_rank=96,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        initializer_range=0.1,
        num_mtp_layers=0,
        pad_token_id=0,
    )
    values.update(TINY_CONFIGS[name])
    values.update(overrides)
    values["num_key_value_heads"] = values["num_attention_heads"]  # MLA: one kv head per head
    return DeepseekV3Config(**values)


def demo(device: str = "cpu", num_prompts: int = 4, new_tokens: int = 8, seed: int = 0) -> int:
    """Serve a tiny random DeepSeek-V3 model over the latent cache and through transformers'
    eager attention; print the cache bytes per token of both forms and whether their greedy
    tokens agree. Returns 0 when they do."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    config = tiny_config("deepseek-v3")
    model = DeepseekV3ForCausalLM(config).to(device=device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, config.vocab_size, (int(n),), generator=generator).tolist()
        for n in torch.randint(3, 40, (num_prompts,), generator=generator)
    ]
    print(
        f"astrai demo --mla: a tiny random DeepSeek-V3 ({config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads, latent {config.kv_lora_rank} + rope "
        f"{config.qk_rope_head_dim}), {dtype}, {device}; {num_prompts} prompts, {new_tokens} "
        "new tokens each"
    )
    for label, shape in (("this model", config), ("DeepSeek-V3 671B", DeepseekV3Config())):
        sizes = cache_bytes_per_token(shape, dtype=torch.bfloat16)
        fp8 = cache_bytes_per_token(shape, torch.bfloat16, torch.float8_e4m3fn)["latent"]
        print(
            f"cache bytes per token ({label}, bf16): latent {sizes['latent']:,} (FP8 latent "
            f"{fp8:,}), decompressed heads {sizes['decompressed']:,} "
            f"({sizes['decompressed'] / sizes['latent']:.0f}x)"
        )
    ours = generate(model, prompts, new_tokens)
    model.set_attn_implementation("eager")
    theirs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        theirs.append(out[0, len(prompt) :].tolist())
    same = sum(a == b for a, b in zip(ours, theirs))
    print(
        f"greedy tokens, latent cache vs transformers' eager attention: {same}/{len(prompts)} "
        "prompts identical"
    )
    if same != len(prompts):
        print("THE LATENT CACHE AND TRANSFORMERS DISAGREE", file=sys.stderr)
        return 1
    return 0
