"""Models whose attention needs the cuda kernels' newer rows run every attention layer on them
(issue 48): head dims (192, 128) of DeepSeek's decompressed MHA form, DeepSeek V3.2's sparse
top-k indices on that row, and Gemma 4's per-layer head dims (256 on its sliding layers, 512 on
its global ones). Tiny configs from the Config classes with the models' real head dims, random
weights, nothing downloaded.

Which backend ran each call is what astrai itself reports: the name of the profiler range that
``visibility.run_visibly`` opens for each call (``astr::attention[cuda:decode/split x1]``),
recorded per call while the ``astrai`` logger takes INFO (which makes every call visible), and
counted against the model's forward passes, so that every layer of every step is accounted for.

On a GPU (``@pytest.mark.cuda`` tests) the models run in bf16 and every call must be on the
cuda backend; the same code runs here on the CPU in float32 on torch_native (``*_logic`` tests),
so that the harness and the comparisons are exercised before the GPU run.

- DeepSeek V3 runs ``generate_batch`` through ``"paged|astrai"`` (transformers' continuous
  batching over its own pages) and gives transformers' greedy tokens.
- DeepSeek V3.2 and Gemma 4 are not served by transformers 5.25's continuous batching (a layer
  type it refuses; a per-layer head dim it cannot read), so a decode loop drives them through
  astrai's own API: a ``PagedKVCache`` with each layer's kv heads and head dims, appended and
  attended by ``astrai.attention`` in every layer (the model's q/k/v as it computes them;
  transformers' own cache still runs the rest of the model, e.g. V3.2's indexer keys, and its
  attention keys are not read). The loop is teacher-forced with eager's greedy tokens, so the
  cuda run and the torch_native run see the same inputs and their logits are compared.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import List, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from packaging.version import Version  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import astrai.integrations.transformers as astrai_transformers  # noqa: E402
import tests.integrations.greedy as greedy  # noqa: E402
from astrai.extension import PagedKVCache, attention, attn_backend, visibility  # noqa: E402
from tests.integrations.tiny_configs import TINY, VOCAB, deepseek  # noqa: E402

astrai_transformers.register()

needs_transformers_5_25 = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.25"),
    reason=f"written for transformers 5.25's models and paged cache, found "
    f"{transformers.__version__}",
)
pytestmark = needs_transformers_5_25

# DeepSeek's multi-head latent attention, decompressed: q/k head dim 128 + 64 = 192, v 128 (the
# cuda kernels' row 192/128).
MLA = deepseek(
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
)
# DeepSeek V3.2's sparse attention: 8 keys per query token, far fewer than a prompt's.
DSA = dict(MLA, index_topk=8, index_head_dim=128, index_n_heads=2)
# Gemma 4: head dim 256 on its sliding layer, 512 on its global one; a window of 8.
GEMMA4 = dict(
    head_dim=256,
    global_head_dim=512,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=VOCAB,
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BACKEND = "cuda" if ON_GPU else "torch_native"  # where every call must run


def tiny_model(config_class: str, model_class: str, overrides: dict, device=DEVICE, dtype=DTYPE):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    return getattr(transformers, model_class)(config).to(device=device, dtype=dtype).eval()


def deepseek_v3(**kwargs):
    return tiny_model("DeepseekV3Config", "DeepseekV3ForCausalLM", MLA, **kwargs)


def deepseek_v32(**kwargs):
    return tiny_model("DeepseekV32Config", "DeepseekV32ForCausalLM", DSA, **kwargs)


def gemma4(**kwargs):
    return tiny_model("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, **kwargs)


def decoder_layers(model) -> int:
    return len(model.model.layers)


# -- which backend ran each call, as astrai reports it ---------------------------------------


class RecordedRanges:
    """The profiler range name ``visibility.range_name`` gives each attention call (its backend,
    and on cuda its kernel form), one per call, and the model's forward passes."""

    def __init__(self, monkeypatch, model):
        self.names: List[str] = []
        self.forwards = 0
        # Each test decides every call form afresh (nothing remembered from earlier tests).
        monkeypatch.setattr(visibility, "_CHOICES", {})
        monkeypatch.setattr(visibility, "_KERNELS", {})
        original = visibility.range_name

        def recording(args):
            name = original(args)
            self.names.append(name)
            return name

        monkeypatch.setattr(visibility, "range_name", recording)
        self._hook = model.model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.forwards += 1

    @contextlib.contextmanager
    def visible(self):
        """Every call made visible (the logger at INFO), as a user watching would."""
        logger = logging.getLogger("astrai")
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            yield self
        finally:
            logger.setLevel(level)
            self._hook.remove()

    def _brackets(self) -> List[str]:
        """What each name holds between its brackets: ``cuda:decode/split x1``, ``torch_native``."""
        return [name[len("astr::attention[") :].rstrip("]") for name in self.names]

    def backends(self) -> set:
        """``{"cuda"}``, ``{"torch_native"}``, ...: the backends of the calls."""
        return {inside.split(":")[0] for inside in self._brackets()}

    def kernels(self) -> set:
        """The cuda kernel forms of the calls (``decode/split x1``, ``topk/split x4``)."""
        return {inside.split(":", 1)[1] for inside in self._brackets() if ":" in inside}

    def assert_every_layer_of_every_step_ran_on(self, backend: str, layers: int) -> None:
        assert self.forwards > 0
        assert len(self.names) == layers * self.forwards, (len(self.names), self.forwards)
        assert self.backends() == {backend}, sorted(set(self.names))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- DeepSeek V3: generate_batch through "paged|astrai" ---------------------------------------

PROMPT_LENGTHS = (3, 17, 9, 26, 1, 40)


def prompts(lengths=PROMPT_LENGTHS):
    return greedy.random_prompts(VOCAB, lengths)


def generate_batch(model, implementation, steps=8):
    """Greedy tokens of every prompt through transformers' continuous batching: pages of 16, a
    small token budget (prompts prefilled in chunks, batches mixing prefill and decode), no CUDA
    graphs (so that every step's attention calls run, and are seen, from Python)."""
    return greedy.generate_batch(
        model,
        implementation,
        prompts(),
        steps,
        block_size=16,
        num_blocks=64,
        max_batch_tokens=24,
        use_cuda_graph=False,
        use_async_batching=False,
    )


def generate_each_prompt_alone(model, implementation, steps=8):
    return greedy.generate_each_prompt_alone(model, implementation, prompts(), steps)


def deepseek_v3_generate_batch_runs_every_layer_on(backend, monkeypatch):
    """(astrai's tokens, the ranges recorded) of DeepSeek V3 through "paged|astrai"."""
    model = deepseek_v3()
    recorded = RecordedRanges(monkeypatch, model)
    with recorded.visible():
        tokens = generate_batch(model, astrai_transformers.PAGED_NAME)
    recorded.assert_every_layer_of_every_step_ran_on(backend, decoder_layers(model))
    return model, tokens, recorded


def test_deepseek_v3_generate_batch_logic(monkeypatch):
    """On the CPU: every layer of every step on torch_native, float32 tokens equal to eager's."""
    if ON_GPU:
        pytest.skip("the GPU runs test_gpu_deepseek_v3_generate_batch_runs_on_cuda_kernels")
    model, tokens, _ = deepseek_v3_generate_batch_runs_every_layer_on(BACKEND, monkeypatch)
    assert tokens == generate_each_prompt_alone(model, "eager")


@pytest.mark.cuda
def test_gpu_deepseek_v3_generate_batch_runs_on_cuda_kernels(monkeypatch):
    """bf16: every layer of every step on astrai's cuda kernels at head dims 192/128, decode and
    prefill, and the greedy tokens of transformers' "paged|eager" up to bf16's near ties (the
    check of tests/integrations/test_transformers.py)."""
    from tests.integrations.test_transformers import assert_same_up_to_near_ties

    model, tokens, recorded = deepseek_v3_generate_batch_runs_every_layer_on("cuda", monkeypatch)
    # Prefill-mode steps of up to 16 new tokens a sequence run as a verify on the decode forms.
    forms = {kernel.split("/")[0] for kernel in recorded.kernels()}
    assert "decode" in forms and forms & {"prefill", "verify"}, recorded.kernels()
    reference = generate_batch(model, "paged|eager")
    assert_same_up_to_near_ties(model, prompts(), reference, tokens)


# -- a decode loop through astrai's own API: PagedKVCache and astrai.attention per layer ------

LOOP_NAME = "astrai_test_paged_loop"


@dataclass
class LoopState:
    """What the attention function of the loop reads: the cache, this step's mode, and what a
    test changes (a backend, an argument dropped for a control)."""

    cache: Optional[PagedKVCache] = None
    fwd: str = "prefill"
    shapes: dict = field(default_factory=dict)  # layer -> (kv heads, head dim, v head dim)
    drop: tuple = ()  # astrai.attention arguments left out (controls)
    # DeepSeek V3.2's indexer picks its keys from hidden states that bf16 rounds differently on
    # two backends: the indices of every call, in order, recorded by one run and replayed by
    # another, so that both attend over the same keys.
    indices: Optional[list] = None
    replay: bool = False


_LOOP = LoopState()


def loop_attention(
    module,
    query,  # [B, Hq, L, D]
    key,  # [B, Hkv, cached + L, D] (transformers' cache holds them too; only the new L are used)
    value,  # [B, Hkv, cached + L, Dv]
    attention_mask,  # transformers' mask: the paged call's causality and window replace it
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    sinks=None,
    indices=None,  # int32 [B, L, topk]: positions along the keys, here within each sequence
    **kwargs,
):
    """transformers' attention interface over astrai's PagedKVCache: the step's new k/v appended
    to the layer's pools, q attending over them through ``astrai.attention``."""
    astrai_transformers._check_kwargs(kwargs)
    assert not dropout, "dropout"
    new = query.shape[2]
    if _LOOP.cache is None:  # the shape probe: each layer's kv heads and head dims
        _LOOP.shapes[module.layer_idx] = (key.shape[1], key.shape[-1], value.shape[-1])
        batch, heads, length, _ = query.shape
        return query.new_zeros(batch, length, heads, value.shape[-1]), None
    window = astrai_transformers._layer_window(module, sliding_window)
    variants = dict(
        scale=scaling,
        window_left=-1 if window is None else window - 1,
        softcap=softcap,
        sinks=astrai_transformers._sinks(s_aux, sinks, query.shape[1]),
        topk_indices=indices,
    )
    if indices is not None and _LOOP.indices is not None:
        if _LOOP.replay:
            variants["topk_indices"] = _LOOP.indices.pop(0)
        else:
            _LOOP.indices.append(indices)
    for name in _LOOP.drop:
        variants.pop(name)
    out = attention(
        query.transpose(1, 2),  # [B, L, Hq, D]: B sequences of L new tokens each
        key[:, :, -new:].transpose(1, 2),
        value[:, :, -new:].transpose(1, 2),
        kv_cache=_LOOP.cache,
        layer_id=module.layer_idx,
        is_causal=True,
        fwd=_LOOP.fwd,
        **{name: value for name, value in variants.items() if value is not None},
    )
    return out, None


AttentionInterface.register(LOOP_NAME, loop_attention)
AttentionMaskInterface.register(LOOP_NAME, astrai_transformers.attention_mask)


def loop_cache(model, batch: int, page_size: int = 16, num_pages: int = 64) -> PagedKVCache:
    """A PagedKVCache shaped like the model's layers (Gemma 4: each its own head dim), found by
    one probing forward pass."""
    _LOOP.cache, _LOOP.shapes = None, {}
    model.set_attn_implementation(LOOP_NAME)
    with torch.no_grad():
        model(torch.ones(1, 1, dtype=torch.long, device=model.device), use_cache=False)
    layers = [_LOOP.shapes[i] for i in range(len(_LOOP.shapes))]
    return PagedKVCache(
        num_layers=len(layers),
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=[heads for heads, _, _ in layers],
        head_dim=[d for _, d, _ in layers],
        head_dim_v=[dv for _, _, dv in layers],
        dtype=next(model.parameters()).dtype,
        device=model.device,
    )


def paged_loop_logits(
    model, tokens: torch.Tensor, prompt_length: int, drop=(), indices=None, replay=False
) -> torch.Tensor:
    """Logits ``[B, S - prompt_length + 1, vocab]`` of B equal-length sequences ``tokens``
    ``[B, S]``: a prefill of the first ``prompt_length`` tokens, then one decode step per token
    (teacher-forced), every attention layer through astrai's PagedKVCache."""
    batch, total = tokens.shape
    cache = loop_cache(model, batch)
    _LOOP.cache, _LOOP.drop = cache, tuple(drop)
    _LOOP.indices, _LOOP.replay = indices, replay
    past = None  # the model's own cache (DeepSeek V3.2's holds its indexer's keys too)
    steps = [(0, prompt_length)] + [(p, p + 1) for p in range(prompt_length, total)]
    logits = []
    try:
        with torch.no_grad():
            for start, end in steps:
                cache.begin_step(list(range(batch)), [end - start] * batch)
                _LOOP.fwd = "prefill" if start == 0 else "decode"
                positions = torch.arange(start, end, device=tokens.device).expand(batch, -1)
                out = model(
                    tokens[:, start:end],
                    position_ids=positions,
                    cache=past,
                    use_cache=True,
                )
                past = out.past_key_values
                logits.append(out.logits[:, -1].float())
    finally:
        _LOOP.cache, _LOOP.drop, _LOOP.indices, _LOOP.replay = None, (), None, False
    return torch.stack(logits, dim=1)


def eager_greedy(model, prompt: torch.Tensor, steps: int):
    """eager's greedy continuation of equal-length prompts ``[B, P]``, and its logits at the last
    prompt token and after each generated one but the last (``[B, steps, vocab]``)."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, dim=1).float()


LOOP_PROMPT, LOOP_STEPS = 24, 8


def loop_prompts(batch=2, length=LOOP_PROMPT):
    generator = torch.Generator().manual_seed(5)
    return torch.randint(1, VOCAB, (batch, length), generator=generator).to(DEVICE)


def run_loop(model, monkeypatch, backend=None, drop=(), indices=None, replay=False):
    """(logits of the loop over eager's greedy tokens, eager's logits, the recorded ranges);
    indices: a list the run's top-k indices are appended to, or (replay) taken from."""
    tokens, eager_logits = eager_greedy(model, loop_prompts(), LOOP_STEPS)
    recorded = RecordedRanges(monkeypatch, model)
    context = attn_backend(backend) if backend else contextlib.nullcontext()
    with recorded.visible(), context:
        # The tokens eager generated but the last: one logits row per eager step.
        logits = paged_loop_logits(model, tokens[:, :-1], LOOP_PROMPT, drop, indices, replay)
    recorded.forwards -= 1  # the shape probe's pass
    return logits, eager_logits, recorded


# Relative L2 error of the logits: against eager in float32 on the CPU; cuda against
# torch_native on the GPU in bf16 (the same cache, the same inputs; test_transformers.py's bf16
# logits check allows 2e-2 relative). Each control moves them by 0.7 to 1.2 (CPU).
CPU_TOLERANCE, GPU_TOLERANCE = 1e-4, 3e-2


def assert_loop_matches(model, monkeypatch, feature: str, kernel_forms=("prefill", "decode")):
    """The loop runs every layer of every step on BACKEND (on cuda, kernels of exactly
    ``kernel_forms``: "topk" for the top-k kernels) and matches its reference; the control
    (astrai made to drop ``feature``) does not."""
    if ON_GPU:
        indices = []
        reference, _, native = run_loop(model, monkeypatch, "torch_native", indices=indices)
        native.assert_every_layer_of_every_step_ran_on("torch_native", decoder_layers(model))
        logits, _, recorded = run_loop(model, monkeypatch, indices=indices, replay=True)
        assert not indices, "every recorded call's indices replayed"
        forms = {kernel.split("/")[0] for kernel in recorded.kernels()}
        assert forms == set(kernel_forms), recorded.kernels()
        tolerance = GPU_TOLERANCE
    else:
        logits, reference, recorded = run_loop(model, monkeypatch)
        tolerance = CPU_TOLERANCE
    recorded.assert_every_layer_of_every_step_ran_on(BACKEND, decoder_layers(model))
    assert relative_error(logits, reference) < tolerance
    dropped, _, _ = run_loop(model, monkeypatch, drop=(feature,))
    assert relative_error(dropped, reference) > 5 * tolerance, f"without {feature}"


# DeepSeek V3.2: the indexer's top-k positions reach astrai as topk_indices.


def test_deepseek_v32_decode_loop_logic(monkeypatch):
    """On the CPU: every layer on torch_native, eager's logits in float32; without the indices
    (dense attention) they differ."""
    if ON_GPU:
        pytest.skip("the GPU runs test_gpu_deepseek_v32_decode_loop_runs_the_cuda_topk_kernels")
    assert_loop_matches(deepseek_v32(), monkeypatch, "topk_indices")


@pytest.mark.cuda
def test_gpu_deepseek_v32_decode_loop_runs_the_cuda_topk_kernels(monkeypatch):
    """bf16: every layer of every step (prefill and decode) on the cuda top-k kernels at head dims
    192/128, matching torch_native over the same cache; without the indices they differ."""
    assert_loop_matches(deepseek_v32(), monkeypatch, "topk_indices", kernel_forms=("topk",))


# Gemma 4: head dim 256 with a window of 8 on the sliding layer, 512 on the global one.


def test_gemma4_decode_loop_logic(monkeypatch):
    """On the CPU: each layer's pools of its own head dim, every layer on torch_native, eager's
    logits in float32; without the sliding window they differ."""
    if ON_GPU:
        pytest.skip("the GPU runs test_gpu_gemma4_decode_loop_runs_on_cuda_kernels")
    model = gemma4()
    cache = loop_cache(model, 2)
    assert cache.layer_head_dims == (256, 512)
    assert_loop_matches(model, monkeypatch, "window_left")


@pytest.mark.cuda
def test_gpu_gemma4_decode_loop_runs_on_cuda_kernels(monkeypatch):
    """bf16: every layer of every step on astrai's cuda kernels (head dims 256 and 512, prefill and
    decode), matching torch_native over the same cache; without the window they differ."""
    assert_loop_matches(gemma4(), monkeypatch, "window_left")
