"""A transformers DeepSeek-V3-architecture model served over astrai's latent paged cache
(astrai/integrations/deepseek_mla.py): tiny random V3 and Kimi-K2-style configs (nothing
downloaded), in float32 on the CPU (the torch_native backend) and in bf16 on a GPU (the cuda
kernel). The latent path's greedy tokens must be transformers' eager attention's, and its logits
close to them."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from astrai import PagedLatentCache
from astrai.integrations import deepseek_mla

PROMPTS = [[5, 17, 200, 3, 9, 44, 101], [7], [300, 12, 12, 8, 451, 2, 90, 61, 77, 19, 4, 4, 8]]


def build(name: str, device="cpu", dtype=torch.float32, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = deepseek_mla.tiny_config(name, **overrides)
    return DeepseekV3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def eager_tokens(model, prompts, new_tokens):
    model.set_attn_implementation("eager")
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_greedy_tokens_match_transformers_eager_attention(name):
    model = build(name)
    ours = deepseek_mla.generate(model, PROMPTS, 6, page_size=4, backend="torch_native")
    assert ours == eager_tokens(model, PROMPTS, 6)


def test_a_model_without_a_query_lora_rank_matches_too():
    """q_lora_rank None (DeepSeek-V2-Lite's layout): q_proj instead of q_a / q_b."""
    model = build("deepseek-v3", q_lora_rank=None, rope_interleave=False)
    ours = deepseek_mla.generate(model, PROMPTS, 4, page_size=16)
    assert ours == eager_tokens(model, PROMPTS, 4)


def test_the_prefill_logits_match_transformers():
    """Beyond argmax: the packed prefill over the latent cache gives transformers' logits."""
    model = build("deepseek-v3")
    model.set_attn_implementation("eager")
    with torch.no_grad():
        expected = [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
        cache = deepseek_mla.latent_cache_for(model, num_pages=16, page_size=4)
        with deepseek_mla.latent_attention(model, cache):
            cache.begin_step([0, 1, 2], [len(p) for p in PROMPTS])
            ids = torch.tensor([[t for p in PROMPTS for t in p]])
            positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    torch.testing.assert_close(logits[ends], torch.stack(expected), atol=2e-4, rtol=2e-4)
    # The model's own attention modules are back.
    assert all(
        type(layer.self_attn).__name__ == "DeepseekV3Attention" for layer in model.model.layers
    )


def test_the_cache_holds_the_latent_not_the_heads():
    model = build("deepseek-v3")
    config = model.config
    cache = deepseek_mla.latent_cache_for(model, num_pages=8, page_size=4)
    ckv, krope = cache.layer(0)
    assert ckv.shape == (8, 4, config.kv_lora_rank) and krope.shape == (8, 4, 64)
    sizes = deepseek_mla.cache_bytes_per_token(DeepseekV3Config())  # the full DeepSeek-V3
    assert sizes["latent"] == 61 * 576 * 2
    assert sizes["decompressed"] == 61 * 128 * (128 + 64 + 128) * 2
    assert sizes["decompressed"] / sizes["latent"] > 70
    assert (
        cache.bytes_per_token()
        == deepseek_mla.cache_bytes_per_token(config, torch.float32)["latent"]
    )


def test_an_fp8_latent_cache_keeps_the_greedy_tokens_close():
    """The FP8 latent (each layer's scale set from its first prefill's latents) changes the
    numbers a little: most greedy tokens survive. A check that the path runs end to end."""
    model = build("deepseek-v3", dtype=torch.bfloat16)
    ours = deepseek_mla.generate(model, PROMPTS, 4, latent_dtype=torch.float8_e4m3fn)
    bf16 = deepseek_mla.generate(model, PROMPTS, 4)
    assert sum(a[0] == b[0] for a, b in zip(ours, bf16)) >= 2


def test_a_keyword_latent_attention_cannot_honour_raises_naming_it():
    model = build("deepseek-v3")
    cache = deepseek_mla.latent_cache_for(model, num_pages=8, page_size=4)
    ids, positions = torch.tensor([PROMPTS[0]]), torch.arange(len(PROMPTS[0]))[None]
    with torch.no_grad(), deepseek_mla.latent_attention(model, cache):
        cache.begin_step([0], [len(PROMPTS[0])])
        with pytest.raises(NotImplementedError, match="indices: the decoder layer passed"):
            model(input_ids=ids, position_ids=positions, use_cache=False, indices=positions)
        with pytest.raises(NotImplementedError, match="cache: LatentAttention keeps"):
            model(input_ids=ids, position_ids=positions, use_cache=True)
        with pytest.raises(NotImplementedError, match="attention_mask: LatentAttention does"):
            padded = torch.ones_like(ids)
            padded[0, 0] = 0
            model(input_ids=ids, attention_mask=padded, position_ids=positions, use_cache=False)
        # A refused call wrote nothing; the same step still serves.
        assert cache.seq_len(0) == len(PROMPTS[0])
        model(input_ids=ids, position_ids=positions, use_cache=False)


def test_a_cache_of_the_wrong_shape_is_refused():
    model = build("deepseek-v3")
    cache = PagedLatentCache(3, 4, 4, latent_dim=256, dtype=torch.float32)
    with pytest.raises(ValueError, match="cache: 3 layers of latent 256"):
        with deepseek_mla.latent_attention(model, cache):
            pass


def test_the_demo_agrees():
    assert deepseek_mla.demo("cpu", num_prompts=2, new_tokens=3) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2"])
def test_greedy_tokens_on_the_cuda_kernel(name):
    """bf16 on the GPU: the latent path runs the cuda kernel; transformers' eager attention in
    bf16 rounds differently, so compare with the torch_native latent path (float32 scores) and
    check that the cuda backend ran."""
    model = build(name, device="cuda", dtype=torch.bfloat16)
    ours = deepseek_mla.generate(model, PROMPTS, 6, backend="cuda")
    reference = deepseek_mla.generate(model, PROMPTS, 6, backend="torch_native")
    assert sum(a == b for a, b in zip(ours, reference)) >= 2


def test_the_demo_command_line_serves_the_latent_cache(capsys):
    """python -m astrai.demo --mla: the bytes-per-token line and the agreement line."""
    from astrai import demo

    assert demo.main(["--mla", "--device", "cpu", "--prompts", "2", "--new-tokens", "2"]) == 0
    printed = capsys.readouterr().out
    assert "cache bytes per token (DeepSeek-V3 671B, bf16): latent 70,272" in printed
    assert "2/2 prompts identical" in printed
