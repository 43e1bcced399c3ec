"""transformers models run their attention through astrai: ``attn_implementation="astrai"``
matches transformers' own SDPA (logits, gradients, padded batches, greedy generation), and
continuous batching with ``"paged|astrai"`` gives the same greedy tokens as transformers' own
paged SDPA. Every comparison has a control showing it fails when the mask, the window, the
cache or the attention itself is ignored. Tiny models built from configs: random weights,
nothing downloaded."""

from __future__ import annotations

import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from packaging.version import Version  # noqa: E402
from transformers import (  # noqa: E402
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

import astrai.integrations.transformers as astrai_transformers  # noqa: E402
from astrai.extension import AttentionBackend, attention, attn_backend, explain  # noqa: E402
from tests.reference import dense_reference  # noqa: E402

astrai_transformers.register()

VERSION = Version(transformers.__version__)
PAGED_REFERENCE = astrai_transformers.TRANSFORMERS_PAGED
ATTENTION_PARAMETERS = inspect.signature(attention).parameters
VOCAB = 128


def needs_attention_argument(name: str):
    return pytest.mark.skipif(
        name not in ATTENTION_PARAMETERS,
        reason=f"astrai.extension.attention has no `{name}` argument in this build (the "
        f"attention-variants change adds it)",
    )


def tiny_llama(device="cpu", dtype=torch.float32, head_dim=16, seed=0, **overrides):
    """GQA (4 query heads, 2 kv heads), two layers, random weights."""
    config = dict(
        vocab_size=VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
    )
    config.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).to(device=device, dtype=dtype).eval()


def tiny_mistral(sliding_window=5, seed=0):
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        max_position_embeddings=512,
    )
    return MistralForCausalLM(config).eval()


def logits_with(model, implementation, input_ids, attention_mask=None):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids, attention_mask=attention_mask).logits.float()


def left_padded_batch(lengths, total, seed=1):
    torch.manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), total))
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, total - length :] = 1
        ids[row, : total - length] = 0
    return ids, mask


def break_attention(monkeypatch, **overrides):
    """Make astrai's ``attention`` inside the integration run with ``overrides`` (the controls:
    each comparison must fail under it)."""

    def broken(q, k, v, **kwargs):
        kwargs.update(overrides)
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(astrai_transformers, "attention", broken)


# -- dense -----------------------------------------------------------------------------------


def test_logits_match_sdpa():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 24))
    reference = logits_with(model, "sdpa", ids)
    torch.testing.assert_close(logits_with(model, "astrai", ids), reference, atol=2e-5, rtol=1e-5)


def test_logits_match_eager_in_float64():
    """transformers' eager attention is the definition (matmul, softmax, matmul); it takes the
    softmax in float32, hence the tolerance."""
    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 20))
    reference = logits_with(model, "eager", ids)
    torch.testing.assert_close(logits_with(model, "astrai", ids), reference, atol=1e-6, rtol=0)


def test_control_logits_differ_when_attention_ignores_causality(monkeypatch):
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 24))
    reference = logits_with(model, "sdpa", ids)
    break_attention(monkeypatch, is_causal=False)
    assert (logits_with(model, "astrai", ids) - reference).abs().max() > 1e-2


def test_gradients_match_sdpa():
    def gradients(implementation):
        model = tiny_llama()
        model.train()
        model.set_attn_implementation(implementation)
        torch.manual_seed(3)
        ids = torch.randint(0, VOCAB, (2, 16))
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    reference = gradients("sdpa")
    ours = gradients("astrai")
    for name, grad in reference.items():
        torch.testing.assert_close(ours[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert any(ours[n].abs().max() > 0 for n in ours if "q_proj" in n)  # attention is in the graph


def test_control_gradients_differ_when_attention_ignores_causality(monkeypatch):
    def q_proj_gradient():
        model = tiny_llama()
        model.train()
        model.set_attn_implementation("astrai")
        torch.manual_seed(3)
        ids = torch.randint(0, VOCAB, (2, 16))
        model(ids, labels=ids).loss.backward()
        return model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    reference = q_proj_gradient()
    break_attention(monkeypatch, is_causal=False)
    assert (q_proj_gradient() - reference).abs().max() > 1e-4


def test_left_padded_batch_matches_sdpa_and_each_sequence_alone():
    model = tiny_llama()
    lengths, total = [20, 13, 7], 20
    ids, mask = left_padded_batch(lengths, total)
    reference = logits_with(model, "sdpa", ids, mask)
    ours = logits_with(model, "astrai", ids, mask)
    for row, length in enumerate(lengths):
        real = slice(total - length, total)  # pad positions are not compared (no real query)
        torch.testing.assert_close(ours[row, real], reference[row, real], atol=2e-5, rtol=1e-5)
        # Positions restart after the padding (transformers derives them from the mask).
        alone = logits_with(model, "astrai", ids[row : row + 1, real])
        torch.testing.assert_close(ours[row, real], alone[0], atol=2e-5, rtol=1e-5)


def test_control_padded_logits_differ_when_the_mask_is_ignored(monkeypatch):
    model = tiny_llama()
    lengths, total = [20, 13, 7], 20
    ids, mask = left_padded_batch(lengths, total)
    reference = logits_with(model, "sdpa", ids, mask)
    break_attention(monkeypatch, attn_mask=None, is_causal=True)
    ours = logits_with(model, "astrai", ids, mask)
    shortest = slice(total - lengths[-1], total)
    assert (ours[-1, shortest] - reference[-1, shortest]).abs().max() > 1e-2


def greedy(model, implementation, ids, mask, steps=12):
    model.set_attn_implementation(implementation)
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=0)
    config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=config)
    return out[:, ids.shape[1] :]


def test_greedy_generate_with_transformers_cache_matches_sdpa():
    model = tiny_llama()
    ids, mask = left_padded_batch([11, 6, 9], 11)
    reference = greedy(model, "sdpa", ids, mask)
    assert torch.equal(greedy(model, "astrai", ids, mask), reference)


def test_control_greedy_tokens_differ_when_the_mask_is_ignored(monkeypatch):
    model = tiny_llama()
    ids, mask = left_padded_batch([11, 6, 9], 11)
    reference = greedy(model, "sdpa", ids, mask)
    break_attention(monkeypatch, attn_mask=None)
    assert not torch.equal(greedy(model, "astrai", ids, mask), reference)


def test_gqa_runs_with_the_kv_heads_as_they_are(monkeypatch):
    seen = []

    def recording(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(astrai_transformers, "attention", recording)
    model = tiny_llama()
    logits_with(model, "astrai", torch.randint(0, VOCAB, (1, 8)))
    assert seen == [(4, 2, 2)] * 2  # two layers, 4 query heads over 2 kv heads, no repeat


def test_the_module_scaling_is_passed_on():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16))
    default = logits_with(model, "astrai", ids)
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.05
    reference = logits_with(model, "sdpa", ids)
    ours = logits_with(model, "astrai", ids)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    assert (ours - default).abs().max() > 1e-3  # control: the scale changes the result


class RecordingBackend(AttentionBackend):
    """A backend written in Python: counts its calls and runs them on torch_native."""

    def __init__(self):
        self.calls = 0

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        self.calls += 1
        return attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, backend="torch_native")


def test_an_attn_backend_context_applies_inside_the_model():
    model = tiny_llama()
    ids, mask = left_padded_batch([9, 5], 9)
    reference = logits_with(model, "sdpa", ids, mask)
    backend = RecordingBackend()
    with attn_backend(backend):
        ours = logits_with(model, "astrai", ids, mask)
    assert backend.calls == 2  # one call per layer went through the context's backend
    torch.testing.assert_close(ours[:, -5:], reference[:, -5:], atol=2e-5, rtol=1e-5)


class PagedRecordingBackend(AttentionBackend):
    """A backend written in Python for paged calls: counts them and runs them on torch_native."""

    def __init__(self):
        self.calls = 0

    def forward(
        self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False, fwd=None
    ):
        self.calls += 1
        return attention(
            q,
            k,
            v,
            kv_cache=kv_cache,
            layer_id=layer_id,
            attn_mask=attn_mask,
            is_causal=is_causal,
            fwd=fwd,
            backend="torch_native",
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a strict choice that cannot run")
def test_a_strict_attn_backend_that_cannot_run_the_call_raises_inside_the_model():
    model = tiny_llama()
    with attn_backend("cuda"), pytest.raises(RuntimeError, match="Explicitly-set backend"):
        logits_with(model, "astrai", torch.randint(0, VOCAB, (1, 8)))


def test_dropout_is_refused_with_a_clear_error():
    model = tiny_llama(attention_dropout=0.1)
    model.train()
    model.set_attn_implementation("astrai")
    with pytest.raises(NotImplementedError, match="dropout"):
        model(torch.randint(0, VOCAB, (1, 8)))


def test_sliding_window_mask_matches_sdpa():
    model = tiny_mistral(sliding_window=5)
    ids = torch.randint(0, VOCAB, (2, 16))
    reference = logits_with(model, "sdpa", ids)
    torch.testing.assert_close(logits_with(model, "astrai", ids), reference, atol=2e-5, rtol=1e-5)
    model.config.sliding_window = None  # control: the window changes the result
    assert (logits_with(model, "sdpa", ids) - reference).abs().max() > 1e-3


class FakeModule(torch.nn.Module):
    is_causal = True


def qkv_heads_first(seed=5, q_len=12):
    torch.manual_seed(seed)
    q = torch.randn(2, 4, q_len, 16)
    k = torch.randn(2, 2, q_len, 16)
    v = torch.randn(2, 2, q_len, 16)
    return q, k, v


@needs_attention_argument("window_left")
def test_a_sliding_window_without_a_mask_uses_window_left():
    q, k, v = qkv_heads_first()
    out, _ = astrai_transformers.attention_forward(
        FakeModule(), q, k, v, None, scaling=0.25, sliding_window=4
    )
    blhd = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    # transformers' window of 4 is the query's own position and the 3 before it
    expected = dense_reference(*blhd, is_causal=True, scale=0.25, window_left=3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    full = dense_reference(*blhd, is_causal=True, scale=0.25)
    assert (out.double() - full).abs().max() > 1e-2  # control: the window matters here


@needs_attention_argument("softcap")
def test_softcap_is_passed_on():
    q, k, v = qkv_heads_first()
    q = q * 4  # scores large enough for the cap to matter
    out, _ = astrai_transformers.attention_forward(
        FakeModule(), q, k, v, None, scaling=0.25, softcap=3.0
    )
    blhd = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    expected = dense_reference(*blhd, is_causal=True, scale=0.25, softcap=3.0)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert (out.double() - dense_reference(*blhd, is_causal=True, scale=0.25)).abs().max() > 1e-2


@needs_attention_argument("sinks")
def test_sinks_are_passed_on():
    q, k, v = qkv_heads_first()
    sinks = torch.tensor([0.5, 2.0, -1.0, 3.0])
    out, _ = astrai_transformers.attention_forward(
        FakeModule(), q, k, v, None, scaling=0.25, s_aux=sinks
    )
    blhd = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    expected = dense_reference(*blhd, is_causal=True, scale=0.25, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert (out.double() - dense_reference(*blhd, is_causal=True, scale=0.25)).abs().max() > 1e-2


def test_a_variant_this_astrai_lacks_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(astrai_transformers, "_ATTENTION_PARAMETERS", {})
    q, k, v = qkv_heads_first()
    with pytest.raises(NotImplementedError, match="softcap"):
        astrai_transformers.attention_forward(FakeModule(), q, k, v, None, softcap=3.0)


# -- continuous batching ----------------------------------------------------------------------


def continuous_batching_config(page_size=8, num_blocks=96, max_batch_tokens=24):
    # Small token budget: prompts are prefilled in chunks, and batches mix prefill and decode.
    name = (
        "page_size"
        if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters
        else "block_size"
    )
    return ContinuousBatchingConfig(
        **{name: page_size}, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens
    )


RAGGED_PROMPT_LENGTHS = (3, 17, 9, 33, 1, 26)


def ragged_prompts(lengths=RAGGED_PROMPT_LENGTHS):
    torch.manual_seed(11)
    return [torch.randint(0, VOCAB, (n,)).tolist() for n in lengths]


def generate_batch(model, implementation, steps=10, lengths=RAGGED_PROMPT_LENGTHS, page_size=8):
    prompts = ragged_prompts(lengths)
    model.set_attn_implementation("sdpa")
    model.config._attn_implementation = implementation
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=0)
    config.eos_token_id = None
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=config,
        continuous_batching_config=continuous_batching_config(page_size),
        progress_bar=False,
    )
    by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in outputs.values()}
    return [by_prompt[tuple(p)] for p in prompts]


class RecordedCalls:
    """astrai's attention calls inside continuous batching: their mode, page size, and whether
    the pools shared storage with transformers' cache (read in place)."""

    def __init__(self, monkeypatch):
        self.calls = []

        def recording(q, k, v, kv_cache=None, **kwargs):
            if kv_cache is not None:
                k_pages, _ = kv_cache.layer(0)
                self.calls.append((kwargs.get("fwd"), k_pages.shape[1], k_pages))
            return attention(q, k, v, kv_cache=kv_cache, **kwargs)

        monkeypatch.setattr(astrai_transformers, "attention", recording)


def test_continuous_batching_matches_transformers_paged_sdpa(monkeypatch):
    model = tiny_llama()
    reference = generate_batch(model, PAGED_REFERENCE)
    recorded = RecordedCalls(monkeypatch)
    assert generate_batch(model, astrai_transformers.PAGED_NAME) == reference
    modes = {mode for mode, _, _ in recorded.calls}
    assert modes == {"prefill", "decode"}
    # Full-attention layers read transformers' own pages (page size 8), not a gathered copy.
    assert {page for _, page, _ in recorded.calls} == {8}


def test_continuous_batching_reads_transformers_cache_in_place(monkeypatch):
    model = tiny_llama()
    pools = []
    original = astrai_transformers._full_attention_pools

    def recording(cache, layer_idx, *shape):
        found = original(cache, layer_idx, *shape)
        pools.append((found[0], cache))
        return found

    monkeypatch.setattr(astrai_transformers, "_full_attention_pools", recording)
    generate_batch(model, astrai_transformers.PAGED_NAME, steps=3, lengths=(5, 9))
    assert pools
    for k_pages, cache in pools:
        storage = k_pages.untyped_storage().data_ptr()
        owners = getattr(cache, "key_cache", None) or [cache.cache_tensor]
        assert any(owner.untyped_storage().data_ptr() == storage for owner in owners)


def test_control_continuous_batching_differs_when_the_cached_tokens_are_ignored(monkeypatch):
    model = tiny_llama()
    reference = generate_batch(model, PAGED_REFERENCE)
    original = astrai_transformers._full_attention_step

    def without_cache(*args, **kwargs):
        step = original(*args, **kwargs)
        # Each sequence "has" only its new tokens: the cached ones are never read.
        step.seq_lens = step.query_start_loc[1:] - step.query_start_loc[:-1]
        return step

    monkeypatch.setattr(astrai_transformers, "_full_attention_step", without_cache)
    assert generate_batch(model, astrai_transformers.PAGED_NAME) != reference


def test_continuous_batching_sliding_window_layers_match(monkeypatch):
    model = tiny_mistral(sliding_window=5)
    reference = generate_batch(model, PAGED_REFERENCE)
    assert generate_batch(model, astrai_transformers.PAGED_NAME) == reference
    # Control: the same layers without their window give other tokens.
    monkeypatch.setattr(astrai_transformers, "_layer_window", lambda module, window: None)
    assert generate_batch(model, astrai_transformers.PAGED_NAME) != reference


def test_dense_use_after_continuous_batching_is_unchanged():
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (1, 12))
    before = logits_with(model, "astrai", ids)
    generate_batch(model, astrai_transformers.PAGED_NAME, steps=2, lengths=(4, 6))
    torch.testing.assert_close(logits_with(model, "astrai", ids), before)


def test_an_attn_backend_context_reaches_continuous_batching_on_its_own_thread():
    model = tiny_llama()
    reference = generate_batch(model, PAGED_REFERENCE, steps=4, lengths=(5, 9))
    backend = PagedRecordingBackend()
    with attn_backend(backend):
        ours = generate_batch(model, astrai_transformers.PAGED_NAME, steps=4, lengths=(5, 9))
    assert ours == reference
    assert backend.calls > 0


# -- H200 (bf16) ------------------------------------------------------------------------------


def gpu_llama(dtype=torch.bfloat16, **overrides):
    # head_dim 64: a head dim astrai's cuda kernels serve.
    return tiny_llama(device="cuda", dtype=dtype, head_dim=64, initializer_range=0.2, **overrides)


def assert_same_up_to_near_ties(model, prompts, reference, tokens):
    """Two bf16 implementations may pick different tokens where the true top two are closer than
    bf16's own error. Where a sequence first differs, a float32 copy of the model must rank the
    two tokens closer than twice the error of the bf16 model's logits there (transformers' SDPA,
    against the float32 copy); the rest of that sequence is not compared (it continues from
    another token). Most sequences must match."""
    exact = type(model)(model.config).to("cuda").float().eval()
    exact.load_state_dict({name: w.float() for name, w in model.state_dict().items()})
    exact.set_attn_implementation("sdpa")
    model.set_attn_implementation("sdpa")
    identical = 0
    for prompt, want, got in zip(prompts, reference, tokens):
        assert len(want) == len(got)
        step = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if step is None:
            identical += 1
            continue
        prefix = torch.tensor([prompt + want[:step]], device="cuda")
        with torch.no_grad():
            logits = exact(prefix).logits[0, -1]
            bf16_error = (model(prefix).logits[0, -1].float() - logits).abs().max()
        gap = (logits[want[step]] - logits[got[step]]).abs()
        assert gap <= 2 * bf16_error, (len(prompt), step, gap.item(), bf16_error.item())
    assert identical >= len(prompts) // 2, f"only {identical}/{len(prompts)} sequences identical"


@pytest.mark.cuda
def test_gpu_dense_logits_gradients_padding_and_generation_match_sdpa():
    model = gpu_llama()
    lengths, total = [24, 15, 8], 24
    ids, mask = left_padded_batch(lengths, total)
    ids, mask = ids.cuda(), mask.cuda()
    reference = logits_with(model, "sdpa", ids, mask)
    ours = logits_with(model, "astrai", ids, mask)
    for row, length in enumerate(lengths):
        real = slice(total - length, total)
        torch.testing.assert_close(ours[row, real], reference[row, real], atol=5e-2, rtol=2e-2)
    prompts = [ids[row, total - n :].tolist() for row, n in enumerate(lengths)]
    assert_same_up_to_near_ties(
        model,
        prompts,
        greedy(model, "sdpa", ids, mask).tolist(),
        greedy(model, "astrai", ids, mask).tolist(),
    )

    def q_grad(implementation):
        trained = gpu_llama()
        trained.train()
        trained.set_attn_implementation(implementation)
        trained(ids, attention_mask=mask, labels=ids).loss.backward()
        return trained.model.layers[0].self_attn.q_proj.weight.grad.float()

    reference_grad = q_grad("sdpa")
    error = (q_grad("astrai") - reference_grad).norm() / reference_grad.norm()
    assert error < 2e-2


GPU_PROMPT_LENGTHS = (5, 40, 17, 90, 1, 63, 33, 8)


@pytest.mark.cuda
def test_gpu_continuous_batching_in_float32_gives_transformers_tokens():
    """float32 on the GPU (astrai's torch_native over transformers' pages): exact."""
    model = gpu_llama(dtype=torch.float32)
    run = dict(steps=24, lengths=GPU_PROMPT_LENGTHS, page_size=16)
    reference = generate_batch(model, PAGED_REFERENCE, **run)
    assert generate_batch(model, astrai_transformers.PAGED_NAME, **run) == reference


@pytest.mark.cuda
def test_gpu_continuous_batching_bf16_matches_transformers_up_to_near_ties():
    model = gpu_llama()
    run = dict(steps=24, lengths=GPU_PROMPT_LENGTHS, page_size=16)
    reference = generate_batch(model, PAGED_REFERENCE, **run)
    ours = generate_batch(model, astrai_transformers.PAGED_NAME, **run)
    assert_same_up_to_near_ties(model, ragged_prompts(GPU_PROMPT_LENGTHS), reference, ours)


@pytest.mark.cuda
def test_gpu_control_continuous_batching_fails_the_check_when_the_cache_is_ignored(monkeypatch):
    model = gpu_llama()
    run = dict(steps=24, lengths=GPU_PROMPT_LENGTHS, page_size=16)
    reference = generate_batch(model, PAGED_REFERENCE, **run)
    original = astrai_transformers._full_attention_step

    def without_cache(*args, **kwargs):
        step = original(*args, **kwargs)
        step.seq_lens = step.query_start_loc[1:] - step.query_start_loc[:-1]
        return step

    monkeypatch.setattr(astrai_transformers, "_full_attention_step", without_cache)
    ours = generate_batch(model, astrai_transformers.PAGED_NAME, **run)
    with pytest.raises(AssertionError):
        assert_same_up_to_near_ties(model, ragged_prompts(GPU_PROMPT_LENGTHS), reference, ours)


@pytest.mark.cuda
def test_gpu_continuous_batching_decode_runs_astrai_cuda_kernels(monkeypatch):
    decisions = []

    def explaining(q, k, v, kv_cache=None, **kwargs):
        if kv_cache is not None:
            arguments = {n: kwargs[n] for n in ("attn_mask", "is_causal", "fwd", "scale")}
            decisions.append((kwargs["fwd"], explain(q, kv_cache=kv_cache, **arguments).backend))
        return attention(q, k, v, kv_cache=kv_cache, **kwargs)

    model = gpu_llama()
    generate_batch(model, astrai_transformers.PAGED_NAME, steps=2, lengths=(4, 6))  # warm up
    monkeypatch.setattr(astrai_transformers, "attention", explaining)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        generate_batch(model, astrai_transformers.PAGED_NAME, steps=8, lengths=(4, 6, 9))
    assert ("decode", "cuda") in decisions and ("prefill", "cuda") in decisions
    assert {backend for _, backend in decisions} == {"cuda"}
    kernels = {event.name for event in profile.events() if event.device_type.name == "CUDA"}
    assert any("append_kv" in name for name in kernels), sorted(kernels)
    assert any("paged" in name for name in kernels), sorted(kernels)


def test_an_untested_transformers_version_warns_as_astrai(monkeypatch):
    from astrai.extension import AstraiWarning
    from astrai.integrations import transformers as integration

    monkeypatch.setattr(integration.transformers, "__version__", "1.0.0")
    with pytest.warns(AstraiWarning, match="found 1.0.0") as record:
        integration.register()
    assert record[0].filename == __file__  # attributed to the caller's line, not astrai's
