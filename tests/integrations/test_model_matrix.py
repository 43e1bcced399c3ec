"""Every current architecture of the installed transformers runs right through astrai: each
model, built from its Config class with tiny sizes (random weights, nothing downloaded), gives
transformers' own "eager" results with ``attn_implementation="astrai"`` (float32 on the CPU):

- the logits of a left-padded batch,
- greedy generation with transformers' cache,
- training gradients of every parameter,
- continuous batching (``generate_batch``) with ``"paged|astrai"`` against eager generating
  each prompt alone, where transformers' continuous batching serves the model (a test notices
  when it starts serving one it does not today).

Each attention feature a model uses has a control: with astrai made to drop that feature (a
sliding window or chunked attention from the mask, softcap, sinks, the sparse indices, the
module's scaling), the logits comparison fails, so the inputs exercise it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from packaging.version import Version  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
)
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function  # noqa: E402

import astrai.integrations.transformers as astrai_transformers  # noqa: E402
import tests.integrations.greedy as greedy  # noqa: E402
from astrai.extension import attention  # noqa: E402
from tests.integrations.tiny_configs import TINY, VOCAB, deepseek  # noqa: E402

astrai_transformers.register()

# DeepSeek's multi-head latent attention in its decompressed form: q/k head dim 24 (16 + 8
# rope), v head dim 12.
MLA = deepseek(
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12
)
DSA = dict(MLA, index_topk=4, index_head_dim=16, index_n_heads=2)  # sparse: 4 keys per query
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Arch:
    config: str  # transformers' Config class
    model: str  # its causal LM class
    overrides: dict = field(default_factory=dict)
    # The attention features it uses, each with a control (FEATURE_CONTROLS).
    features: tuple = ()
    # Whether transformers' continuous batching serves it (else: the error it raises).
    continuous_batching: bool = True


ARCHITECTURES = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", dict(head_dim=16)),
    "llama4": Arch(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            head_dim=16,
            attention_chunk_size=6,
            num_local_experts=2,
            intermediate_size_mlp=96,
            no_rope_layer_interval=2,
        ),
        features=("chunked",),
        continuous_batching=False,  # "Invalid layer type: chunked_attention"
    ),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": Arch(
        "MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=5), ("window",)
    ),
    "gemma2": Arch(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=16, sliding_window=5, attn_logit_softcapping=2.0, query_pre_attn_scalar=24),
        ("window", "softcap", "scaling"),
    ),
    "gemma3": Arch(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=24,
            layer_types=SLIDING_THEN_FULL,
        ),
        ("window", "scaling"),
    ),
    # Head dim 16 on the sliding layer, 32 on the global one (Gemma 4: 256 and 512).
    "gemma4": Arch(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            head_dim=16,
            global_head_dim=32,
            sliding_window=5,
            layer_types=SLIDING_THEN_FULL,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=VOCAB,
        ),
        ("window", "scaling"),
        continuous_batching=False,  # AmbiguousGlobalPerLayerAttributeError: head_dim
    ),
    "gpt_oss": Arch(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            sliding_window=5,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=SLIDING_THEN_FULL,
        ),
        ("window", "sinks"),
    ),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=None)),
    "deepseek_v3": Arch("DeepseekV3Config", "DeepseekV3ForCausalLM", MLA, ("scaling",)),
    "deepseek_v32": Arch(
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        DSA,
        ("indices", "scaling"),
        continuous_batching=False,  # "Invalid layer type: indexed_attention"
    ),
    "glm_moe_dsa": Arch(
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        DSA,
        ("indices", "scaling"),
        continuous_batching=False,  # "Invalid layer type: indexed_attention"
    ),
    # A sliding layer and a compressed-sparse one (its indexer's choice is in the mask's bias).
    "deepseek_v4": Arch(
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            head_dim=16,
            q_lora_rank=24,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            sliding_window=5,
            index_topk=4,
            index_head_dim=16,
            index_n_heads=2,
            o_groups=2,
            o_lora_rank=16,
            num_key_value_heads=1,
            layer_types=["sliding_attention", "compressed_sparse_attention"],
        ),
        ("window", "sinks"),
        continuous_batching=False,  # "Invalid layer type: sliding_attention" groups with CSA
    ),
    # Other models whose attention uses a feature astrai claims (a window, softcap).
    "olmo3": Arch(
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(sliding_window=5, layer_types=SLIDING_THEN_FULL),
        ("window",),
    ),
    "cohere2": Arch(
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(sliding_window=5, layer_types=SLIDING_THEN_FULL),
        ("window",),
    ),
    "exaone4": Arch(
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(sliding_window=5, layer_types=SLIDING_THEN_FULL),
        ("window",),
    ),
    "vaultgemma": Arch(
        "VaultGemmaConfig",
        "VaultGemmaForCausalLM",
        dict(
            head_dim=16,
            sliding_window=5,
            attn_logit_softcapping=2.0,
            query_pre_attn_scalar=24,
            layer_types=SLIDING_THEN_FULL,
        ),
        ("window", "softcap", "scaling"),
    ),
}
# The continuous-batching rows follow transformers 5.25's paged cache; 5.17's cannot serve some of
# these models in its own "paged|eager" either (DeepSeek V3's q/k and v head dims differ).
needs_paged_cache_of_5_25 = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.25"),
    reason=f"continuous batching rows are written for transformers >= 5.25, found "
    f"{transformers.__version__}",
)
SERVED = [name for name, arch in ARCHITECTURES.items() if arch.continuous_batching]
NOT_SERVED = [name for name, arch in ARCHITECTURES.items() if not arch.continuous_batching]
CONTROLS = [(name, feature) for name, arch in ARCHITECTURES.items() for feature in arch.features]


@functools.cache
def tiny_model(name: str):
    arch = ARCHITECTURES[name]
    torch.manual_seed(0)
    config = getattr(transformers, arch.config)(**{**TINY, **arch.overrides})
    return getattr(transformers, arch.model)(config).eval()


def left_padded_batch():
    """Three rows of 13, 9 and 16 tokens, left-padded to 16: longer than every window (5),
    chunk (6) and top-k (4), so each feature changes the result."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 16), generator=generator)
    mask = torch.ones(3, 16, dtype=torch.long)
    for row, length in enumerate((13, 9, 16)):
        mask[row, : 16 - length] = 0
        ids[row, : 16 - length] = 0
    return ids, mask


def logits(model, implementation):
    ids, mask = left_padded_batch()
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
    return out[mask.bool()]  # the real tokens' rows


def close(a, b):
    return torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_dense_logits_of_a_left_padded_batch_match_eager(name):
    model = tiny_model(name)
    eager = logits(model, "eager")
    ours = logits(model, astrai_transformers.NAME)
    torch.testing.assert_close(ours, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_generation_matches_eager(name):
    model = tiny_model(name)
    ids, mask = left_padded_batch()
    tokens = {}
    for implementation in ("eager", astrai_transformers.NAME):
        model.set_attn_implementation(implementation)
        tokens[implementation] = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert torch.equal(tokens[astrai_transformers.NAME], tokens["eager"])


def gradients(model, implementation):
    """The loss and every parameter's gradient of a training step over the padded batch. Only
    predictions made from real tokens count: a padding row sees no key, which eager answers with
    a uniform average and astrai with zeros, and the first real token's label would be predicted
    from it."""
    ids, mask = left_padded_batch()
    predicted_from_a_real_token = torch.zeros_like(mask)
    predicted_from_a_real_token[:, 1:] = mask[:, :-1] * mask[:, 1:]
    labels = ids.masked_fill(predicted_from_a_real_token == 0, -100)
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    model.train()
    try:
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    finally:
        model.eval()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_training_gradients_match_eager(name):
    model = tiny_model(name)
    eager_loss, eager = gradients(model, "eager")
    our_loss, ours = gradients(model, astrai_transformers.NAME)
    torch.testing.assert_close(our_loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert ours.keys() == eager.keys() and len(ours) > 0
    for parameter, grad in eager.items():
        torch.testing.assert_close(ours[parameter], grad, atol=1e-5, rtol=1e-3, msg=parameter)


# -- continuous batching -------------------------------------------------------------------


PROMPT_LENGTHS = (3, 17, 9, 26, 1)


def prompts():
    return greedy.random_prompts(VOCAB, PROMPT_LENGTHS)


def generate_batch(model, implementation, steps=6):
    # A small token budget: prompts are prefilled in chunks onto cached pages, and batches mix
    # prefill and decode.
    return greedy.generate_batch(
        model, implementation, prompts(), steps, block_size=8, num_blocks=48, max_batch_tokens=20
    )


def generate_each_prompt_alone(model, implementation, steps=6):
    return greedy.generate_each_prompt_alone(model, implementation, prompts(), steps)


@needs_paged_cache_of_5_25
@pytest.mark.parametrize("name", SERVED)
def test_continuous_batching_matches_eager(name):
    """Against eager generating each prompt alone: transformers' own "paged|eager" is not the
    reference, as it disagrees with its eager on VaultGemma (prompt 0's third token)."""
    model = tiny_model(name)
    assert generate_batch(model, astrai_transformers.PAGED_NAME) == generate_each_prompt_alone(
        model, "eager"
    )


@needs_paged_cache_of_5_25
@pytest.mark.parametrize("name", NOT_SERVED)
def test_transformers_continuous_batching_does_not_serve_it_yet(name):
    """When transformers starts serving one of these, this fails: move it to SERVED."""
    with pytest.raises(Exception, match="layer type|head_dim"):
        generate_batch(tiny_model(name), "paged|eager", steps=1)


@contextlib.contextmanager
def transformers_paged_cache_with_per_layer_head_dims():
    """A stand-in for a transformers whose paged cache sizes each layer group by its own layers'
    head dim: 5.25 reads the global ``config.head_dim``, which Gemma 4's per-layer config
    refuses (AmbiguousGlobalPerLayerAttributeError), in paged|eager as in paged|astrai."""
    from transformers.generation.continuous_batching import cache as paged_cache
    from transformers.generation.continuous_batching.cache_allocators.full_attention import (
        FullAttentionCacheAllocator,
    )

    original_init, original_find = FullAttentionCacheAllocator.__init__, paged_cache.find_head_dim

    def init(self, index, config, *args, **kwargs):
        layer_indices = kwargs.get("layer_indices", args[3] if len(args) > 3 else None)
        if getattr(config, "is_heterogeneous", False):
            config = config.per_layer_config[layer_indices[0]]
        original_init(self, index, config, *args, **kwargs)

    def find_head_dim(config):  # the memory estimate: the largest layer's
        if getattr(config, "is_heterogeneous", False):
            return max(original_find(layer) for layer in config.per_layer_config)
        return original_find(config)

    FullAttentionCacheAllocator.__init__ = init
    paged_cache.find_head_dim = find_head_dim
    try:
        yield
    finally:
        FullAttentionCacheAllocator.__init__ = original_init
        paged_cache.find_head_dim = original_find


@needs_paged_cache_of_5_25
def test_gemma4_continuous_batching_waits_only_on_transformers_paged_cache():
    """astrai's side reads per-layer head dims (each layer's pools as transformers shapes them,
    q/k/v as they come): once transformers' cache does too, Gemma 4 (head dim 16 on its sliding
    layer, 32 on its global one) runs through "paged|astrai" and matches eager."""
    model = tiny_model("gemma4")
    with transformers_paged_cache_with_per_layer_head_dims():
        ours = generate_batch(model, astrai_transformers.PAGED_NAME)
    assert ours == generate_each_prompt_alone(model, "eager")


# -- controls: without the feature, the comparison fails --------------------------------------


@contextlib.contextmanager
def astrai_attention_with(**overrides):
    """astrai's attention inside the integration, run with ``overrides``."""
    original = astrai_transformers.attention

    def overridden(q, k, v, **kwargs):
        kwargs.update(overrides)
        return original(q, k, v, **kwargs)

    astrai_transformers.attention = overridden
    try:
        yield
    finally:
        astrai_transformers.attention = original


@contextlib.contextmanager
def astrai_mask_without_its_pattern():
    """astrai's masks built as plain causal ones (padding kept): no sliding window, no chunks."""
    original = astrai_transformers.attention_mask
    original_window = astrai_transformers._layer_window

    def causal_only(*args, **kwargs):
        kwargs.update(mask_function=causal_mask_function, local_size=None)
        return original(*args, **kwargs)

    AttentionMaskInterface.register(astrai_transformers.NAME, causal_only)
    astrai_transformers._layer_window = lambda module, window: None
    try:
        yield
    finally:
        AttentionMaskInterface.register(astrai_transformers.NAME, original)
        astrai_transformers._layer_window = original_window


FEATURE_CONTROLS = {
    "window": astrai_mask_without_its_pattern,
    "chunked": astrai_mask_without_its_pattern,
    "softcap": lambda: astrai_attention_with(softcap=None),
    "sinks": lambda: astrai_attention_with(sinks=None),
    "indices": lambda: astrai_attention_with(topk_indices=None),
    "scaling": lambda: astrai_attention_with(scale=None),
}


@pytest.mark.parametrize("name, feature", CONTROLS, ids=[f"{n}-{f}" for n, f in CONTROLS])
def test_control_the_comparison_fails_when_astrai_drops_the_feature(name, feature):
    model = tiny_model(name)
    eager = logits(model, "eager")
    with FEATURE_CONTROLS[feature]():
        broken = logits(model, astrai_transformers.NAME)
    assert not close(broken, eager), f"{name} without {feature} still matches eager"
    assert close(logits(model, astrai_transformers.NAME), eager)  # and with it, it matches


def test_every_feature_has_a_control():
    assert {f for _, f in CONTROLS} <= FEATURE_CONTROLS.keys()
    # The attention function registered is astrai's (the controls patch what it calls).
    assert AttentionInterface()[astrai_transformers.NAME] is astrai_transformers.attention_forward
    assert astrai_transformers.attention is attention
