"""torch.compile, autograd and CUDA graphs through astr.attention.

- the tiny decoder compiles with ``fullgraph=True`` for training (forward + backward match eager)
  and, on CUDA, for paged inference (prefill + decode match eager; the pools are written in place,
  never copied);
- dynamo guards on the backend choice: an ``attn_backend(...)`` context or ``ASTR_BACKEND``
  change recompiles (or raises), an unchanged choice reuses the graph, and the graph runs the
  backend that was chosen;
- gradients: gradcheck in float64; a backend without backward is never picked for a call that
  needs grad;
- CUDA graphs: a decode step over every layer is captured once and replayed as sequences grow.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

from astrai.extension import (
    AttentionBackend,
    CudaBackend,
    FlashAttnBackend,
    PagedKVCache,
    StepMetadata,
    attention,
    attn_backend,
    explain,
)
from astrai.models import DecoderConfig, TinyDecoder


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def small_config(**overrides) -> DecoderConfig:
    values = dict(
        vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_hidden=64
    )
    values.update(overrides)
    return DecoderConfig(**values)


def dense_qkv(
    batch=1, q_len=3, kv_len=3, q_heads=2, kv_heads=2, head_dim=8, dtype=torch.float32, seed=0
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, q_heads, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g, dtype=dtype)
    return q, k, v


# -- training ----------------------------------------------------------------------------------


def test_tiny_decoder_training_compiles_fullgraph_and_matches_eager():
    torch.manual_seed(0)
    model = TinyDecoder(small_config())
    tokens = torch.randint(0, 64, (2, 6))

    expected = model(tokens)
    expected.square().mean().backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    actual = torch.compile(model, fullgraph=True)(tokens)
    actual.square().mean().backward()
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected_grads[name], atol=1e-4, rtol=1e-4, msg=name)


def test_tiny_decoder_training_is_one_graph_without_breaks():
    model = TinyDecoder(small_config())
    result = torch._dynamo.explain(model)(torch.randint(0, 64, (2, 6)))
    assert result.graph_break_count == 0, result.break_reasons
    assert result.graph_count == 1


# -- paged inference ---------------------------------------------------------------------------

# A ragged prefill of three sequences, then decode steps; decode steps use a fixed block-table
# width so their shapes do not change as sequences grow (one decode graph).
PROMPTS = {0: 5, 1: 3, 2: 9}
DECODE_STEPS = 4
PAGE_SIZE = 4
# A page count no other tensor of the step shares as its first dim, so a pool-shaped buffer in
# the generated code can only be a copy of a pool.
NUM_PAGES = 37


def step_inputs(cache: PagedKVCache, new_tokens: dict, g, vocab: int, width=None):
    """begin_step on ``cache``; returns (tokens [T], positions [T], mode) of the packed step."""
    old = {seq: cache.seq_len(seq) for seq in new_tokens}
    step = cache.begin_step(list(new_tokens), list(new_tokens.values()), block_table_width=width)
    tokens = torch.randint(0, vocab, (sum(new_tokens.values()),), generator=g)
    positions = torch.cat([torch.arange(old[s], old[s] + n) for s, n in new_tokens.items()])
    device = cache.device
    return tokens.to(device), positions.to(device), step.mode


def pool_args(code: str, shape) -> list:
    """Names of the generated wrapper's inputs that have the pools' shape."""
    dims = ", ".join(str(d) for d in shape)
    return re.findall(r"assert_size_stride\((\w+), \(" + re.escape(dims) + r"\)", code)


def call_args(line: str) -> list:
    """The top-level arguments of the first call on a line of generated code."""
    text = line[line.index("(") + 1 :]
    args, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += char
    return args + [current.strip()]


def assert_pools_not_copied(codes, shape, num_layers):
    """The generated code calls append_kv on the pool inputs themselves: no buffer of the
    pools' shape is allocated (a clone) and no copy_ writes a pool back."""
    dims = ", ".join(str(d) for d in shape)
    assert codes, "nothing was compiled"
    for code in codes:
        assert not re.search(r"empty_strided_\w+\(\(" + re.escape(dims) + r"\)", code), code
        pools = pool_args(code, shape)
        assert len(pools) == 2 * num_layers, code
        appends = [
            call_args(line) for line in code.splitlines() if "astr.append_kv.default(" in line
        ]
        assert len(appends) == num_layers, code
        written = {name for args in appends for name in args[2:4]}  # k_cache, v_cache
        assert written == set(pools), code
        for name in pools:
            assert not re.search(rf"\b{name}\.copy_\(|copy_\({name}\b", code), code


def run_compiled_inference(device, dtype, backend, atol, rtol):
    """Prefill + decode steps through eager ``model.step`` on one cache and compiled
    ``model.step`` (fullgraph) on another; outputs and pools must match, pools in place."""
    torch.manual_seed(0)
    config = small_config(head_dim=64 if dtype != torch.float32 else 8)
    model = TinyDecoder(config).to(device=device, dtype=dtype).eval()
    eager_cache = model.make_cache(NUM_PAGES, PAGE_SIZE)
    compiled_cache = model.make_cache(NUM_PAGES, PAGE_SIZE)
    pools = compiled_cache.k_pools + compiled_cache.v_pools
    pointers = [p.data_ptr() for p in pools]
    width = math.ceil((max(PROMPTS.values()) + DECODE_STEPS) / PAGE_SIZE)
    counter = CompileCounterWithBackend("inductor")
    compiled_step = torch.compile(model.step, fullgraph=True, backend=counter)

    steps = [PROMPTS] + [dict.fromkeys(PROMPTS, 1)] * DECODE_STEPS
    codes = []
    with torch.no_grad():
        for i, new_tokens in enumerate(steps):
            fixed = width if i > 0 else None
            inputs = step_inputs(
                eager_cache, new_tokens, torch.Generator().manual_seed(i), config.vocab_size, fixed
            )
            expected = model.step(*inputs[:2], eager_cache, inputs[2], backend=backend)
            inputs = step_inputs(
                compiled_cache,
                new_tokens,
                torch.Generator().manual_seed(i),
                config.vocab_size,
                fixed,
            )
            if i < 2:  # the prefill's and the first decode's generated code
                actual, code = run_and_get_code(
                    compiled_step, *inputs[:2], compiled_cache, inputs[2], backend
                )
                codes += code
            else:
                actual = compiled_step(*inputs[:2], compiled_cache, inputs[2], backend)
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=f"step {i}")
            assert compiled_cache.k_pools + compiled_cache.v_pools == pools
            assert [p.data_ptr() for p in pools] == pointers
            for mine, theirs in zip(pools, eager_cache.k_pools + eager_cache.v_pools):
                torch.testing.assert_close(mine, theirs, atol=atol, rtol=rtol)
    # One graph for the prefill, one for every decode step (same shapes): no graph breaks.
    assert counter.frame_count == 2
    assert_pools_not_copied(codes, tuple(pools[0].shape), config.num_layers)


def test_compiled_paged_inference_matches_eager_on_cpu():
    run_compiled_inference("cpu", torch.float32, None, atol=1e-4, rtol=1e-4)


def test_compiled_append_writes_the_pools_in_place():
    """The part of the cache step that does compile on CPU: astr::append_kv (a mutating op,
    auto-functionalized by AOTAutograd) is re-inplaced by Inductor onto the pool inputs."""
    cache = PagedKVCache(2, NUM_PAGES, PAGE_SIZE, 2, 8, dtype=torch.float32)
    pools = cache.k_pools + cache.v_pools
    pointers = [p.data_ptr() for p in pools]
    cache.begin_step([0, 1], [5, 3])
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 8, 2, 8, generator=g), torch.randn(2, 8, 2, 8, generator=g)

    def append_all_layers(k, v):
        for layer in range(cache.num_layers):
            cache.append(layer, k[layer], v[layer])

    _, codes = run_and_get_code(torch.compile(append_all_layers, fullgraph=True), k, v)
    assert [p.data_ptr() for p in cache.k_pools + cache.v_pools] == pointers
    slots = cache.step.slot_mapping.long()
    for layer in range(cache.num_layers):
        k_pool, v_pool = cache.layer(layer)
        assert torch.equal(k_pool.view(-1, 2, 8)[slots], k[layer])
        assert torch.equal(v_pool.view(-1, 2, 8)[slots], v[layer])
    assert_pools_not_copied(codes, tuple(pools[0].shape), cache.num_layers)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype, backend, atol",
    [(torch.float32, "torch_native", 1e-4), (torch.bfloat16, None, 0.125)],
    ids=["f32-torch_native", "bf16-default"],
)
def test_compiled_paged_inference_matches_eager_on_cuda(dtype, backend, atol):
    run_compiled_inference("cuda", dtype, backend, atol=atol, rtol=2e-2)


@pytest.mark.cuda
def test_compiled_decode_step_is_one_graph_without_breaks():
    model = TinyDecoder(small_config(head_dim=64)).to("cuda", torch.bfloat16).eval()
    cache = model.make_cache(NUM_PAGES, PAGE_SIZE)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        inputs = step_inputs(cache, PROMPTS, g, 64)
        model.step(*inputs[:2], cache, inputs[2])
        inputs = step_inputs(cache, dict.fromkeys(PROMPTS, 1), g, 64)
        result = torch._dynamo.explain(model.step)(*inputs[:2], cache, inputs[2])
    assert result.graph_break_count == 0, result.break_reasons
    assert result.graph_count == 1


# -- the backend choice is guarded -------------------------------------------------------------


class NegatedBackend(AttentionBackend):
    """A Python backend whose result is recognisable: minus torch_native's."""

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        return -torch.ops.astr.attention(q, k, v, attn_mask, is_causal, backend="torch_native")

    fwd_decode = fwd_prefill


def compiled_attention(counter):
    @torch.compile(backend=counter, fullgraph=True)
    def run(q, k, v):
        return attention(q, k, v, is_causal=True)

    return run


def test_context_change_recompiles_and_runs_the_chosen_backend():
    q, k, v = dense_qkv()
    reference = torch.ops.astr.attention(q, k, v, is_causal=True, backend="torch_native")
    counter = CompileCounter()
    run = compiled_attention(counter)

    with attn_backend("torch_native"):
        torch.testing.assert_close(run(q, k, v), reference)
        run(q, k, v)
    assert counter.frame_count == 1  # unchanged choice: no recompile

    with attn_backend(NegatedBackend()):
        torch.testing.assert_close(run(q, k, v), -reference)  # the Python backend ran
        run(q, k, v)
    assert counter.frame_count == 2

    torch.testing.assert_close(run(q, k, v), reference)  # no context: default
    assert counter.frame_count == 3

    with attn_backend("torch_native"):
        torch.testing.assert_close(run(q, k, v), reference)  # the first graph, reused
    torch.testing.assert_close(run(q, k, v), reference)
    assert counter.frame_count == 3


def test_context_change_to_an_incapable_backend_raises_instead_of_reusing():
    q, k, v = dense_qkv()
    counter = CompileCounter()
    run = compiled_attention(counter)
    with attn_backend("torch_native"):
        run(q, k, v)
    with attn_backend("cuda"), pytest.raises(Exception, match="Explicitly-set backend 'cuda'"):
        run(q, k, v)  # dense CPU call: cuda cannot run it, strict
    assert counter.frame_count == 1


def test_environment_change_recompiles(monkeypatch):
    q, k, v = dense_qkv()
    reference = torch.ops.astr.attention(q, k, v, is_causal=True, backend="torch_native")
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    counter = CompileCounter()
    run = compiled_attention(counter)

    run(q, k, v)
    assert counter.frame_count == 1
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    torch.testing.assert_close(run(q, k, v), reference)
    assert counter.frame_count == 2
    run(q, k, v)
    assert counter.frame_count == 2  # unchanged: reused
    # ASTR_BACKEND is not strict: on CPU "cuda" falls back to torch_native, but the graph is
    # retraced (so a GPU run would now pick what the environment says).
    # (The fallback warning is reported once per process, so it is not asserted here.)
    monkeypatch.setenv("ASTR_BACKEND", "cuda")
    decision = explain(q, k, v, is_causal=True)
    assert (decision.source, decision.requested) == ("environment", "cuda")
    torch.testing.assert_close(run(q, k, v), reference)
    assert counter.frame_count == 3
    # A context beats the environment and is guarded on too.
    with attn_backend(NegatedBackend()):
        torch.testing.assert_close(run(q, k, v), -reference)
    assert counter.frame_count == 4


def attention_selections(recorder):
    """The (backend, backend_source) arguments of every astr.attention node the compiler
    recorded."""
    return [
        (node.kwargs.get("backend"), node.kwargs.get("backend_source"))
        for graph in recorder.graphs
        for node in graph.graph.nodes
        if "astr.attention" in str(node.target)
    ]


def test_python_api_graphs_record_the_selection_they_were_traced_under(monkeypatch):
    """The Python API passes the context / ASTR_BACKEND it observed into the op, so graphs
    traced under different choices differ, and a compile cache keyed on the graph (AOTAutograd's
    keys on dynamo's) cannot hand one choice's graph to another."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    q, k, v = dense_qkv()
    recorder = EagerAndRecordGraphs()
    run = torch.compile(
        lambda q, k, v: attention(q, k, v, is_causal=True), backend=recorder, fullgraph=True
    )
    with attn_backend("torch_native"):
        run(q, k, v)
    run(q, k, v)
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    run(q, k, v)
    assert attention_selections(recorder) == [
        ("torch_native", 2),  # a context
        (None, 4),  # the default
        ("torch_native", 3),  # ASTR_BACKEND
    ]


def compiled_direct_call():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def run(q, k, v):
        return torch.ops.astr.attention(q, k, v, is_causal=True)

    return run, counter


def test_direct_op_call_compiled_in_a_context_raises_when_run_outside_it():
    """torch.compile does not guard a direct torch.ops.astr.attention call on the context, so
    the traced graph checks it at run time and refuses to run under another choice."""
    q, k, v = dense_qkv()
    reference = torch.ops.astr.attention(q, k, v, is_causal=True, backend="torch_native")
    run, counter = compiled_direct_call()
    with attn_backend("torch_native"):
        torch.testing.assert_close(run(q, k, v), reference)
        torch.testing.assert_close(run(q, k, v), reference)  # unchanged: runs, no retrace
    with pytest.raises(
        RuntimeError, match="chose its attention backend under context:torch_native"
    ):
        run(q, k, v)
    with attn_backend("torch_native"):
        torch.testing.assert_close(run(q, k, v), reference)
    assert counter.frame_count == 1


def test_direct_op_call_compiled_under_an_environment_raises_after_it_changed(monkeypatch):
    q, k, v = dense_qkv()
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    run, _ = compiled_direct_call()
    run(q, k, v)
    monkeypatch.setenv("ASTR_BACKEND", "cuda")
    with pytest.raises(
        RuntimeError, match="under environment:torch_native, but now runs under environment:cuda"
    ):
        run(q, k, v)


def test_direct_op_call_with_a_backend_argument_is_not_checked():
    """A per-call backend does not depend on the context: no check in the graph."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    q, k, v = dense_qkv()
    recorder = AotEagerAndRecordGraphs()

    @torch.compile(backend=recorder, fullgraph=True)
    def run(q, k, v):
        return torch.ops.astr.attention(q, k, v, is_causal=True, backend="torch_native")

    with attn_backend("torch_native"):
        run(q, k, v)
    run(q, k, v)
    assert "check_trace_state" not in recorder.fw_graphs[0].code


def test_per_call_backend_argument_works_in_compiled_code():
    q, k, v = dense_qkv()
    reference = torch.ops.astr.attention(q, k, v, is_causal=True, backend="torch_native")
    counter = CompileCounter()
    negated = NegatedBackend()

    @torch.compile(backend=counter, fullgraph=True)
    def run(q, k, v, backend):
        return attention(q, k, v, is_causal=True, backend=backend)

    torch.testing.assert_close(run(q, k, v, "torch_native"), reference)
    torch.testing.assert_close(run(q, k, v, negated), -reference)
    # The argument beats the context: no context guard can change its result.
    with attn_backend(negated):
        torch.testing.assert_close(run(q, k, v, "torch_native"), reference)


def test_per_call_incapable_backend_raises_at_trace_time():
    q, k, v = dense_qkv()

    @torch.compile(backend=CompileCounter(), fullgraph=True)
    def run(q, k, v):
        return attention(q, k, v, backend="cuda")

    with pytest.raises(Exception, match="Explicitly-set backend 'cuda'"):
        run(q, k, v)


# -- autograd ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_kind", [None, "bool", "additive"])
def test_gqa_attention_passes_gradcheck(mask_kind):
    q, k, v = dense_qkv(
        batch=2, q_len=3, kv_len=4, q_heads=4, kv_heads=2, head_dim=4, dtype=torch.float64, seed=3
    )
    g = torch.Generator().manual_seed(4)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(3, 4, generator=g) > 0.3
        mask[:, 0] = True  # every query sees a key
    elif mask_kind == "additive":
        mask = torch.randn(2, 1, 3, 4, generator=g, dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def call(q, k, v):
        return torch.ops.astr.attention(q, k, v, attn_mask=mask, is_causal=True)

    assert torch.autograd.gradcheck(call, inputs)


def paged_call_needing_grad(device="cpu", dtype=torch.bfloat16, head_dim=64):
    """A paged prefill (page size 16) whose q requires grad; the pools hold its new tokens."""
    cache = PagedKVCache(1, 4, 16, 2, head_dim, dtype=dtype, device=device)
    cache.begin_step([0], [3])
    kv = torch.randn(3, 2, head_dim, dtype=dtype, device=device)
    cache.append(0, kv, kv)
    q = torch.randn(1, 3, 4, head_dim, dtype=dtype, device=device, requires_grad=True)
    return q, cache


def test_backends_without_backward_reject_calls_needing_grad():
    q, cache = paged_call_needing_grad()
    for backend in (CudaBackend(), FlashAttnBackend()):
        reasons = backend.rejection_reasons(q, kv_cache=cache, fwd="prefill")
        assert any("no backward" in r for r in reasons), (backend, reasons)
        assert not any(
            "no backward" in r
            for r in backend.rejection_reasons(q.detach(), kv_cache=cache, fwd="prefill")
        )


def test_backend_without_backward_is_never_picked_implicitly():
    q, cache = paged_call_needing_grad()
    decision = explain(q, kv_cache=cache, fwd="prefill", is_causal=True)
    assert decision.backend == "torch_native"
    assert any("no backward" in r for r in decision.rejected["cuda"])
    out = attention(q, None, None, kv_cache=cache, fwd="prefill", is_causal=True)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_backend_without_backward_chosen_explicitly_raises():
    q, cache = paged_call_needing_grad()
    decision = explain(q, kv_cache=cache, fwd="prefill", backend="cuda")
    assert decision.backend is None and "no backward" in decision.error
    with pytest.raises(RuntimeError, match="Explicitly-set backend 'cuda'.*no backward"):
        attention(q, None, None, kv_cache=cache, fwd="prefill", backend="cuda")


@pytest.mark.cuda
def test_backend_without_backward_is_never_picked_implicitly_on_cuda():
    q, cache = paged_call_needing_grad(device="cuda")
    if CudaBackend.available():
        assert explain(q.detach(), kv_cache=cache, fwd="prefill").backend == "cuda"
    decision = explain(q, kv_cache=cache, fwd="prefill", is_causal=True)
    assert decision.backend == "torch_native", str(decision)
    out = attention(q, None, None, kv_cache=cache, fwd="prefill", is_causal=True)
    out.float().sum().backward()
    assert q.grad is not None
    with pytest.raises(RuntimeError, match="no backward"):
        attention(q, None, None, kv_cache=cache, fwd="prefill", backend="cuda")


# -- CUDA graphs -------------------------------------------------------------------------------

# Decode over three sequences of different lengths; with 16-token pages each crosses a page
# boundary during the 8 replayed steps.
GRAPH_PROMPTS = {0: 13, 1: 7, 2: 30}
GRAPH_STEPS = 8
GRAPH_PAGE = 16


def decode_fixture():
    """(model bf16 head_dim 64, eager cache, graph cache, width) after the same prefill."""
    torch.manual_seed(0)
    model = TinyDecoder(DecoderConfig(head_dim=64)).to("cuda", torch.bfloat16).eval()
    pages = sum(math.ceil((n + GRAPH_STEPS) / GRAPH_PAGE) for n in GRAPH_PROMPTS.values()) + 1
    width = math.ceil((max(GRAPH_PROMPTS.values()) + GRAPH_STEPS) / GRAPH_PAGE)
    caches = [model.make_cache(pages, GRAPH_PAGE) for _ in range(2)]
    for cache in caches:
        inputs = step_inputs(cache, GRAPH_PROMPTS, torch.Generator().manual_seed(0), 512)
        model.step(*inputs[:2], cache, inputs[2])
    return model, caches[0], caches[1], width


def decode_inputs(cache, step, width):
    return step_inputs(
        cache,
        dict.fromkeys(GRAPH_PROMPTS, 1),
        torch.Generator().manual_seed(100 + step),
        512,
        width,
    )


def assert_decode_matches(actual, expected, step):
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=0.125, rtol=2e-2, msg=f"decode step {step}"
    )


@pytest.mark.cuda
@torch.no_grad()
def test_decode_step_replays_in_a_cuda_graph():
    if not CudaBackend.available():
        pytest.skip("cuda backend unavailable (needs sm_80+ and the CUDA build)")
    model, eager_cache, graph_cache, width = decode_fixture()

    # Static buffers: the first decode step's metadata, tokens and positions.
    tokens, positions, _ = decode_inputs(graph_cache, 0, width)
    first = graph_cache.step
    static = StepMetadata(
        first.block_table.clone(),
        first.seq_lens.clone(),
        first.query_start_loc.clone(),
        first.slot_mapping.clone(),
        1,
        "decode",
    )
    graph_cache.step = static
    static_tokens, static_positions = tokens.clone(), positions.clone()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (rewrites step 0's k/v: same values, same slots)
        for _ in range(2):
            model.step(static_tokens, static_positions, graph_cache, "decode", backend="cuda")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model.step(
            static_tokens, static_positions, graph_cache, "decode", backend="cuda"
        )

    for step in range(GRAPH_STEPS):
        if step > 0:
            tokens, positions, _ = decode_inputs(graph_cache, step, width)
            static.copy_(graph_cache.step)
            graph_cache.step = static
            static_tokens.copy_(tokens)
            static_positions.copy_(positions)
        graph.replay()
        inputs = decode_inputs(eager_cache, step, None)
        expected = model.step(*inputs[:2], eager_cache, "decode", backend="cuda")
        assert torch.equal(inputs[0], static_tokens)
        assert_decode_matches(static_out, expected, step)
    for mine, theirs in zip(
        graph_cache.k_pools + graph_cache.v_pools, eager_cache.k_pools + eager_cache.v_pools
    ):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.cuda
@torch.no_grad()
def test_decode_step_replays_under_reduce_overhead():
    if not CudaBackend.available():
        pytest.skip("cuda backend unavailable (needs sm_80+ and the CUDA build)")
    from torch._dynamo.utils import counters

    model, eager_cache, graph_cache, width = decode_fixture()
    for pool in graph_cache.k_pools + graph_cache.v_pools:
        # The pools are mutated inputs: CUDA graph trees only keep them (and skip copying them
        # into static buffers) when their address is marked static.
        torch._dynamo.mark_static_address(pool)
    pointers = [p.data_ptr() for p in graph_cache.k_pools + graph_cache.v_pools]
    counters.clear()
    compiled = torch.compile(model.step, mode="reduce-overhead", fullgraph=True)
    for step in range(GRAPH_STEPS):
        torch.compiler.cudagraph_mark_step_begin()
        inputs = decode_inputs(graph_cache, step, width)
        actual = compiled(*inputs[:2], graph_cache, "decode", "cuda").clone()
        inputs = decode_inputs(eager_cache, step, None)
        expected = model.step(*inputs[:2], eager_cache, "decode", backend="cuda")
        assert_decode_matches(actual, expected, step)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    # The replayed graphs wrote into the caller's pools, not into copies of them.
    assert [p.data_ptr() for p in graph_cache.k_pools + graph_cache.v_pools] == pointers
    for mine, theirs in zip(
        graph_cache.k_pools + graph_cache.v_pools, eager_cache.k_pools + eager_cache.v_pools
    ):
        # Inductor fuses the projections and rotary embedding differently from eager, so a new
        # k/v entry may differ by one bf16 rounding step; a token written to the wrong slot, or
        # not written, would differ by O(1).
        torch.testing.assert_close(mine, theirs, atol=2e-2, rtol=2e-2)
