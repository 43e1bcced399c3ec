"""How astr.attention picks its backend.

Precedence: the per-call ``backend=`` argument > this thread's innermost ``attn_backend(...)``
context > ``ASTR_BACKEND`` > default priority (cuda > flash > torch_native). An explicit choice
(argument or context) is strict: a call it cannot run raises, naming every backend and why.
ASTR_BACKEND and the default fall back to the next capable backend. Contexts nest as a stack,
per thread. Backends written in Python run only through ``astrai.extension.attention``.

This machine may have no GPU and no flash-attn: cuda and flash are then chosen only explicitly,
and every call resolves to torch_native otherwise.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid

import pytest
import torch

from astrai.extension import (
    AttentionBackend,
    AttentionBackendFactory,
    CudaBackend,
    Decision,
    FlashAttnBackend,
    PagedKVCache,
    TorchNativeBackend,
    attention,
    attn_backend,
    explain,
    get_backend,
    ops,
)

BACKENDS = ("cuda", "flash", "torch_native")
# torch.ops.astr.selected_backend()'s sources (csrc/dispatch/resolver.h: SelectionSource).
CONTEXT, ENVIRONMENT, DEFAULT = 2, 3, 4
NO_GPU = not torch.cuda.is_available()
# The head dims the cuda kernels were built for, as the library reports them (config.h's list:
# "192/128" for q/k head dim 192 with v head dim 128).
CUDA_HEAD_DIMS = ", ".join(
    str(d) if d == dv else f"{d}/{dv}"
    for d, dv in ops.BUILD_INFO["paged_kernels"]["head_dim_pairs"]
)


@pytest.fixture(autouse=True)
def no_environment_backend(monkeypatch):
    """Tests start without ASTR_BACKEND and must leave no context pushed."""
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    yield
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    assert torch.ops.astr.selected_backend() == ("", DEFAULT)
    assert get_backend(use_default=False) is None


def dense_call(dtype=torch.float32, head_dim=8, seed=0):
    """q, k, v [1, 3, 2, head_dim]: a dense call only torch_native can run on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 3, 2, head_dim, generator=g).to(dtype) for _ in range(3))


def optional_context(name):
    return attn_backend(name) if name else contextlib.nullcontext()


# -- precedence ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argument, context, environment, source, requested",
    [
        ("torch_native", "cuda", "flash", "argument", "torch_native"),
        ("torch_native", None, "cuda", "argument", "torch_native"),
        (None, "torch_native", "cuda", "context", "torch_native"),
        (None, "flash", "torch_native", "context", "flash"),
        (None, None, "torch_native", "environment", "torch_native"),
        (None, None, None, "default", ""),
    ],
    ids=[
        "argument>context",
        "argument>environment",
        "context>environment",
        "context>environment-2",
        "environment>default",
        "default",
    ],
)
def test_selection_precedence(monkeypatch, argument, context, environment, source, requested):
    if environment:
        monkeypatch.setenv("ASTR_BACKEND", environment)
    q, k, v = dense_call()
    with optional_context(context):
        decision = explain(q, k, v, backend=argument)
        raw = json.loads(torch.ops.astr.explain(q, k, v, backend=argument))
    assert (decision.source, decision.requested) == (source, requested)
    assert (raw["source"], raw["requested"]) == (source, requested)


def test_argument_beats_context_when_running():
    q, k, v = dense_call()
    with attn_backend("cuda"):  # cannot run a dense fp32 call
        out = attention(q, k, v, backend="torch_native")
    assert out.shape == q.shape


def test_context_beats_environment_when_running(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    q, k, v = dense_call()
    with attn_backend("cuda"), pytest.raises(RuntimeError, match="from an attn_backend"):
        attention(q, k, v)


def test_environment_beats_default():
    """(On a machine without GPU or flash-attn the default is torch_native too; the source
    says which rule chose it.)"""
    q, k, v = dense_call()
    assert explain(q, k, v).source == "default"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASTR_BACKEND", "torch_native")
        decision = explain(q, k, v)
    assert (decision.source, decision.backend) == ("environment", "torch_native")


@pytest.mark.parametrize("environment", ["cuda", "flash"], ids=["env=cuda", "env=flash"])
def test_environment_choice_falls_back_when_it_cannot_run_the_call(monkeypatch, environment):
    monkeypatch.setenv("ASTR_BACKEND", environment)
    q, k, v = dense_call()
    decision = explain(q, k, v)
    assert (decision.source, decision.requested) == ("environment", environment)
    assert decision.backend == "torch_native" and decision.fell_back
    assert attention(q, k, v).shape == q.shape


def test_default_runs_the_first_capable_backend_in_priority_order():
    q, k, v = dense_call()
    decision = explain(q, k, v)
    first_capable = next(name for name in BACKENDS if not decision.rejected[name])
    assert decision.backend == first_capable


# -- contexts: nesting, exceptions, threads -------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [["cuda", "torch_native"], ["torch_native", "flash"], ["torch_native", "cuda", "torch_native"]],
    ids="/".join,
)
def test_inner_context_wins_and_outer_is_restored(names):
    q, k, v = dense_call()

    def enter(depth):
        if depth == len(names):
            return
        with attn_backend(names[depth]) as backend:
            for _ in ("on entry", "after the inner context exited"):
                assert get_backend() is backend
                assert torch.ops.astr.selected_backend() == (names[depth], CONTEXT)
                assert explain(q, k, v).requested == names[depth]
                enter(depth + 1)

    enter(0)
    assert torch.ops.astr.selected_backend() == ("", DEFAULT)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_exception_inside_contexts_restores_the_stack(depth):
    class Boom(Exception):
        pass

    with attn_backend("torch_native") as outer:
        with pytest.raises(Boom):
            with contextlib.ExitStack() as stack:
                for _ in range(depth):
                    stack.enter_context(attn_backend("cuda"))
                raise Boom
        assert get_backend() is outer
        assert torch.ops.astr.selected_backend() == ("torch_native", CONTEXT)


def test_failed_call_inside_a_context_restores_the_stack():
    q, k, v = dense_call()
    with pytest.raises(RuntimeError, match="Explicitly-set backend 'cuda'"):
        with attn_backend("cuda"):
            attention(q, k, v)
    assert torch.ops.astr.selected_backend() == ("", DEFAULT)


def run_in_threads(names, look, barrier_timeout=30):
    """Runs look() in one thread per name, each inside attn_backend(name), while the main
    thread (in no context) looks too; all look at the same time. Returns {name: result}."""
    barrier = threading.Barrier(len(names) + 1, timeout=barrier_timeout)
    results = {}

    def worker(name):
        try:
            with attn_backend(name):
                barrier.wait()  # every thread is inside its context
                results[name] = look()
                barrier.wait()  # nobody leaves before everyone has looked
        except BaseException as error:  # noqa: B036  (reported by the main thread)
            results[name] = error
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()
        results["main"] = look()
        barrier.wait()
    finally:
        for thread in threads:
            thread.join(timeout=barrier_timeout)
    for name, result in results.items():
        if isinstance(result, BaseException):
            raise AssertionError(f"thread {name} failed") from result
    return results


def test_threads_see_only_their_own_context():
    q, k, v = dense_call()

    def look():
        backend = get_backend(use_default=False)
        decision = explain(q, k, v)
        return (
            None if backend is None else backend.name,
            torch.ops.astr.selected_backend(),
            decision.source,
            decision.requested,
        )

    seen = run_in_threads(["cuda", "torch_native"], look)
    assert seen["cuda"] == ("cuda", ("cuda", CONTEXT), "context", "cuda")
    assert seen["torch_native"] == (
        "torch_native",
        ("torch_native", CONTEXT),
        "context",
        "torch_native",
    )
    assert seen["main"] == (None, ("", DEFAULT), "default", "")


def test_threads_run_calls_with_their_own_context():
    q, k, v = dense_call()

    def look():
        try:
            return attention(q, k, v).shape
        except RuntimeError as error:
            return str(error)

    seen = run_in_threads(["cuda", "torch_native"], look)
    assert "Explicitly-set backend 'cuda'" in seen["cuda"]
    assert seen["torch_native"] == q.shape
    assert seen["main"] == q.shape


# -- strict choices and their messages ------------------------------------------------------


def paged_cache_call(dtype=torch.bfloat16, head_dim=64, page_size=16):
    """A one-sequence paged prefill of 3 tokens, q [1, 3, 4, head_dim]."""
    cache = PagedKVCache(1, 2, page_size, 2, head_dim, dtype=dtype)
    cache.begin_step([0], [3])
    q = torch.randn(1, 3, 4, head_dim).to(dtype)
    return q, cache


FORMS = {
    "dense-fp32": lambda: dict(zip("qkv", dense_call())),
    "dense-bf16-d64": lambda: dict(zip("qkv", dense_call(torch.bfloat16, 64))),
    "paged-fp32": lambda: dict(zip(("q", "kv_cache"), paged_cache_call(torch.float32))),
}


@pytest.mark.parametrize("requested", ["cuda", "flash"], ids=["want-cuda", "want-flash"])
@pytest.mark.parametrize("how", ["context", "argument"])
@pytest.mark.parametrize("form", list(FORMS))
def test_explicit_backend_that_cannot_run_raises_naming_every_backend(requested, how, form):
    if not NO_GPU:
        pytest.skip("on a GPU machine these calls may be runnable")
    call = FORMS[form]()
    if "kv_cache" in call:
        call.update(k=None, v=None, fwd="prefill")
    rejected = explain(**call, backend="torch_native").rejected
    with pytest.raises(RuntimeError) as raised:
        if how == "context":
            with attn_backend(requested):
                attention(**call)
        else:
            attention(**call, backend=requested)
    message = str(raised.value)
    phrase = (
        "from an attn_backend(...) context" if how == "context" else "from the backend= argument"
    )
    assert f"Explicitly-set backend '{requested}' ({phrase}) cannot run this call" in message
    for name in BACKENDS:
        reasons = rejected[name]
        assert f"{name}: " + ("; ".join(reasons) if reasons else "can run it") in message


def test_per_call_cuda_is_strict_even_when_the_environment_names_another(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    q, k, v = dense_call(torch.bfloat16, 64)
    with pytest.raises(RuntimeError, match="needs a paged KV cache"):
        torch.ops.astr.attention(q, k, v, backend="cuda")


@pytest.mark.skipif(not NO_GPU, reason="the call is runnable on a GPU machine")
def test_per_call_cuda_is_strict_for_a_paged_call_it_could_run_on_a_gpu():
    q, cache = paged_cache_call()
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors \(got cpu\)"):
        attention(q, None, None, kv_cache=cache, fwd="prefill", backend="cuda")


def test_strict_choice_never_falls_back():
    q, k, v = dense_call()
    decision = explain(q, k, v, backend="cuda")
    assert decision.backend is None and not decision.fell_back
    assert "cannot run this call" in decision.error


# -- unknown names ---------------------------------------------------------------------------


def test_unknown_environment_backend_warns_once_naming_valid_ones(monkeypatch, capfd, recwarn):
    """The warning comes from C++ (TORCH_WARN); called through torch.ops it may reach stderr
    rather than Python's warnings, so both are read."""
    value = f"no-such-backend-{uuid.uuid4().hex[:8]}"  # warned once per process per value
    monkeypatch.setenv("ASTR_BACKEND", value)
    q, k, v = dense_call()
    decisions = [explain(q, k, v), explain(q, k, v)]
    attention(q, k, v)
    torch.ops.astr.selected_backend()
    messages = [str(w.message) for w in recwarn] + capfd.readouterr().err.splitlines()
    hits = [m for m in messages if value in m]
    assert len(hits) == 1, messages
    assert "valid: cuda, flash, torch_native" in hits[0]
    assert all(d.source == "default" and d.requested == "" for d in decisions)


def test_unknown_environment_backend_falls_back_to_default(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", f"bogus-{uuid.uuid4().hex[:8]}")
    q, k, v = dense_call()
    assert torch.ops.astr.selected_backend() == ("", DEFAULT)
    assert get_backend(use_default=False) is None
    assert explain(q, k, v).backend == "torch_native"
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, backend="torch_native"))


UNKNOWN_NAME_CALLS = {
    "attention": lambda q, k, v: attention(q, k, v, backend="bogus"),
    "explain": lambda q, k, v: explain(q, k, v, backend="bogus"),
    "attn_backend": lambda q, k, v: attn_backend("bogus"),
    "op-attention": lambda q, k, v: torch.ops.astr.attention(q, k, v, backend="bogus"),
    "op-explain": lambda q, k, v: torch.ops.astr.explain(q, k, v, backend="bogus"),
    "op-push_backend": lambda q, k, v: torch.ops.astr.push_backend("bogus"),
    "op-push_backend-empty-python-label": lambda q, k, v: torch.ops.astr.push_backend("python:"),
    "op-check_backend": lambda q, k, v: torch.ops.astr.check_backend(
        "bogus", q, None, None, False, None, False
    ),
}


@pytest.mark.parametrize("entry", list(UNKNOWN_NAME_CALLS))
def test_unknown_backend_name_raises_value_error(entry):
    with pytest.raises(ValueError, match="bogus|python:"):
        UNKNOWN_NAME_CALLS[entry](*dense_call())
    assert torch.ops.astr.selected_backend() == ("", DEFAULT)


def test_unknown_backend_name_error_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"valid: cuda, flash, torch_native"):
        torch.ops.astr.attention(*dense_call(), backend="bogus")


def test_pop_without_push_raises():
    with pytest.raises(RuntimeError, match="override stack is empty"):
        torch.ops.astr.pop_backend()


# -- explain ---------------------------------------------------------------------------------


def test_explain_names_the_backend_and_why_the_others_were_not_taken():
    q, k, v = dense_call()
    decision = explain(q, k, v)
    assert isinstance(decision, Decision)
    assert decision.backend == "torch_native"
    assert set(decision.rejected) == set(BACKENDS)
    assert decision.rejected["torch_native"] == []
    if NO_GPU:
        assert "needs CUDA tensors (got cpu)" in decision.rejected["cuda"]
        assert "needs CUDA tensors (got cpu)" in decision.rejected["flash"]
    assert any("needs a paged KV cache" in r for r in decision.rejected["cuda"])
    assert any("dtype float32 not supported" in r for r in decision.rejected["flash"])
    text = str(decision)
    assert "backend: torch_native" in text and "torch_native: can run it" in text


def test_explain_of_a_paged_call_appends_nothing():
    q, cache = paged_cache_call()
    k_pool, v_pool = (t.clone() for t in cache.layer(0))
    k = torch.randn(1, 3, 2, 64).to(torch.bfloat16)
    decision = explain(q, k, k, kv_cache=cache, fwd="prefill")
    assert decision.backend == "torch_native"
    assert not any("needs a paged KV cache" in r for r in decision.rejected["cuda"])
    assert torch.equal(cache.layer(0)[0], k_pool) and torch.equal(cache.layer(0)[1], v_pool)


def test_explain_and_attention_agree():
    q, k, v = dense_call(torch.bfloat16, 64)
    mask = torch.rand(3, 3) < 0.5
    mask[:, 0] = True
    assert explain(q, k, v, attn_mask=mask, is_causal=True).backend == "torch_native"
    torch.testing.assert_close(
        attention(q, k, v, attn_mask=mask, is_causal=True),
        attention(q, k, v, attn_mask=mask, is_causal=True, backend="torch_native"),
    )


# -- the cuda backend's layout rules --------------------------------------------------------
# Its kernels copy 16-byte pieces of rows and address a page with 32-bit offsets: a pool (or q)
# outside those rules makes the resolver pass cuda by, with the reason, like any other rule.

LAYOUTS = {
    # a pool that starts one element into its storage
    "offset": (lambda p, s, h, d, **kw: torch.randn(p * s * h * d + 1, **kw)[1:].view(p, s, h, d)),
    # rows of 68 elements of which 64 are used: strides not multiples of 8
    "stride": (lambda p, s, h, d, **kw: torch.randn(p, s, h, d + 4, **kw)[..., :d]),
    # every other element: a last dim that is not contiguous
    "last-dim": (lambda p, s, h, d, **kw: torch.randn(p, s, h, 2 * d, **kw)[..., ::2]),
}
LAYOUT_REASONS = {
    "offset": "k_cache must start on a 16-byte boundary (storage offset 1 elements)",
    "stride": "k_cache strides [2176, 136, 68, 1] must be multiples of 8 elements",
    "last-dim": "k_cache needs a contiguous last dim (stride 1), got strides",
}


def paged_decode_with_layout(layout, device):
    """A bf16 decode (2 sequences, 4 q heads over 2 kv heads, D=64, 4 pages of 16 slots) whose
    k_cache has the named layout (None: a plain contiguous pool)."""
    g = torch.Generator(device=device).manual_seed(11)
    kw = dict(dtype=torch.bfloat16, device=device, generator=g)
    make = LAYOUTS.get(layout, lambda p, s, h, d, **kw: torch.randn(p, s, h, d, **kw))
    k_cache = make(4, 16, 2, 64, **kw)
    v_cache = torch.randn(4, 16, 2, 64, **kw)
    args = dict(
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([20, 31], dtype=torch.int32, device=device),
        mode="decode",
    )
    return torch.randn(2, 4, 64, **kw), args


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_layout_the_cuda_copies_cannot_read_is_a_cuda_rejection_reason(layout):
    q, args = paged_decode_with_layout(layout, "cpu")
    reasons = json.loads(torch.ops.astr.explain(q, **args))["reasons"]
    assert any(LAYOUT_REASONS[layout] in r for r in reasons["cuda"]), reasons["cuda"]
    assert reasons["torch_native"] == []


def test_a_plain_pool_gives_the_cuda_backend_no_layout_reason():
    q, args = paged_decode_with_layout(None, "cpu")
    reasons = json.loads(torch.ops.astr.explain(q, **args))["reasons"]
    assert not any("16-byte" in r or "stride" in r for r in reasons["cuda"]), reasons["cuda"]


@pytest.mark.cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_layout_rule_implicit_falls_back_and_explicit_raises(layout):
    q, args = paged_decode_with_layout(layout, "cuda")
    decision = json.loads(torch.ops.astr.explain(q, **args))
    assert decision["backend"] == "torch_native"
    assert any(LAYOUT_REASONS[layout] in r for r in decision["reasons"]["cuda"])
    implicit = torch.ops.astr.attention(q, **args)
    reference = torch.ops.astr.attention(q, backend="torch_native", **args)
    torch.testing.assert_close(implicit, reference)
    with pytest.raises(RuntimeError, match="Explicitly-set backend 'cuda'") as raised:
        torch.ops.astr.attention(q, backend="cuda", **args)
    assert LAYOUT_REASONS[layout] in str(raised.value)
    # The same values in a fresh, plain pool run on the cuda kernels (a fresh allocation: the
    # "offset" view is already contiguous, so .contiguous() would keep its offset).
    plain = dict(args, k_cache=args["k_cache"].clone(memory_format=torch.contiguous_format))
    assert json.loads(torch.ops.astr.explain(q, **plain))["backend"] == "cuda"
    torch.testing.assert_close(
        torch.ops.astr.attention(q, **plain).float(), reference.float(), atol=2e-2, rtol=2e-2
    )


# -- backends written in Python --------------------------------------------------------------


class EchoQueryBackend(AttentionBackend):
    """Returns q (times two): shows that this backend, not a built-in one, ran."""

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        return q * 2

    def fwd_decode(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        return q * 2


def test_python_backend_in_a_context_makes_the_op_raise():
    q, k, v = dense_call()
    with attn_backend(EchoQueryBackend()):
        assert torch.ops.astr.selected_backend() == ("python:EchoQueryBackend", CONTEXT)
        with pytest.raises(RuntimeError, match="is written in Python") as raised:
            torch.ops.astr.attention(q, k, v)
        raw = json.loads(torch.ops.astr.explain(q, k, v))
    assert "astrai.extension.attention" in str(raised.value)
    assert raw["backend"] is None and "written in Python" in raw["error"]


def test_python_backend_in_a_context_runs_through_the_python_api():
    q, k, v = dense_call()
    with attn_backend(EchoQueryBackend()):
        torch.testing.assert_close(attention(q, k, v), q * 2)
        assert explain(q, k, v).backend == "EchoQueryBackend"


def test_per_call_builtin_beats_a_python_backend_context():
    q, k, v = dense_call()
    with attn_backend(EchoQueryBackend()):
        out = attention(q, k, v, backend="torch_native")
    torch.testing.assert_close(out, attention(q, k, v))


@pytest.fixture
def registered_echo():
    name = f"echo_{uuid.uuid4().hex[:8]}"
    AttentionBackendFactory.register(name, EchoQueryBackend)
    try:
        yield name
    finally:
        AttentionBackendFactory._registry.pop(name, None)


def test_registered_python_backend_is_selectable_by_name(registered_echo):
    q, k, v = dense_call()
    assert registered_echo in AttentionBackendFactory.list_registered()
    with attn_backend(registered_echo) as backend:
        assert isinstance(backend, EchoQueryBackend)
        assert get_backend() is backend
        torch.testing.assert_close(attention(q, k, v), q * 2)
    torch.testing.assert_close(attention(q, k, v, backend=registered_echo), q * 2)


def test_registering_a_taken_name_raises(registered_echo):
    with pytest.raises(ValueError, match="already registered"):
        AttentionBackendFactory.register(registered_echo, EchoQueryBackend)
    with pytest.raises(ValueError, match="already registered"):
        AttentionBackendFactory.register("torch_native", EchoQueryBackend)


def test_registering_a_non_backend_raises():
    with pytest.raises(TypeError, match="backend_cls"):
        AttentionBackendFactory.register(f"not_{uuid.uuid4().hex[:8]}", object)


# -- supports_call: the form rules of each built-in backend ---------------------------------


def _dense(dtype=torch.bfloat16, head_dim=64, mask=None, grad=False):
    q = torch.randn(1, 3, 4, head_dim, dtype=dtype, requires_grad=grad)
    return (q, None, mask, False, None)


def _paged(dtype=torch.bfloat16, head_dim=64, page_size=16, mask=None, grad=False, head_dim_v=None):
    cache = PagedKVCache(1, 1, page_size, 2, head_dim, dtype=dtype, head_dim_v=head_dim_v)
    q = torch.randn(1, 3, 4, head_dim, dtype=dtype, requires_grad=grad)
    return (q, cache, mask, True, "prefill")


BOOL_MASK = torch.ones(3, 5, dtype=torch.bool)
ADDITIVE_MASK = torch.zeros(3, 5, dtype=torch.bfloat16)

# (form id, form, {backend: None when supported, else a phrase of the reason})
SUPPORT_TABLE = [
    (
        "paged-bf16-d64",
        lambda: _paged(),
        {CudaBackend: None, FlashAttnBackend: "multiple of 256", TorchNativeBackend: None},
    ),
    (
        "paged-fp32",
        lambda: _paged(torch.float32),
        {
            CudaBackend: "dtype float32 not supported",
            FlashAttnBackend: "dtype float32",
            TorchNativeBackend: None,
        },
    ),
    (
        "dense-fp32",
        lambda: _dense(torch.float32),
        {
            CudaBackend: "dtype float32 not supported",
            FlashAttnBackend: "dtype float32",
            TorchNativeBackend: None,
        },
    ),
    ("paged-d96", lambda: _paged(head_dim=96), {CudaBackend: None, TorchNativeBackend: None}),
    ("paged-d512", lambda: _paged(head_dim=512), {CudaBackend: None, TorchNativeBackend: None}),
    (
        "paged-d192-v128",
        lambda: _paged(head_dim=192, head_dim_v=128),
        {CudaBackend: None, TorchNativeBackend: None},
    ),
    (
        "paged-d192-v96",
        lambda: _paged(head_dim=192, head_dim_v=96),
        {
            CudaBackend: "unsupported head_dim 192 with v head_dim 96",
            TorchNativeBackend: None,
        },
    ),
    (
        "paged-d80",
        lambda: _paged(head_dim=80),
        {
            CudaBackend: f"unsupported head_dim 80 (supported: {CUDA_HEAD_DIMS})",
            TorchNativeBackend: None,
        },
    ),
    (
        "dense-d80",
        lambda: _dense(head_dim=80),
        {CudaBackend: "head_dim 80", FlashAttnBackend: None, TorchNativeBackend: None},
    ),
    (
        "dense-d100",
        lambda: _dense(head_dim=100),
        {FlashAttnBackend: "head_dim 100 not supported", TorchNativeBackend: None},
    ),
    (
        "dense-additive-mask",
        lambda: _dense(mask=ADDITIVE_MASK.view(1, 1, 3, 5)),
        {FlashAttnBackend: "custom attention mask not supported", TorchNativeBackend: None},
    ),
    (
        "dense-bool-mask",
        lambda: _dense(mask=BOOL_MASK),
        {FlashAttnBackend: "custom attention mask not supported", TorchNativeBackend: None},
    ),
    (
        "paged-additive-mask",
        lambda: _paged(mask=ADDITIVE_MASK),
        {
            CudaBackend: "additive (float) masks not supported",
            FlashAttnBackend: "custom attention mask",
            TorchNativeBackend: None,
        },
    ),
    ("paged-bool-mask", lambda: _paged(mask=BOOL_MASK), {CudaBackend: None}),
    (
        "paged-page256",
        lambda: _paged(page_size=256),
        {CudaBackend: None, FlashAttnBackend: None, TorchNativeBackend: None},
    ),
    (
        "dense-no-cache",
        lambda: _dense(),
        {CudaBackend: "needs a paged KV cache", FlashAttnBackend: None, TorchNativeBackend: None},
    ),
    (
        "paged-requires-grad",
        lambda: _paged(grad=True),
        {CudaBackend: "has no backward", TorchNativeBackend: None},
    ),
]
SUPPORT_CASES = [
    pytest.param(make, backend_cls, reason, id=f"{backend_cls.name}-{form_id}")
    for form_id, make, expected in SUPPORT_TABLE
    for backend_cls, reason in expected.items()
]


@pytest.mark.parametrize("make_form, backend_cls, reason", SUPPORT_CASES)
def test_supports_call_follows_the_form_rules(make_form, backend_cls, reason):
    backend = backend_cls()
    form = make_form()
    assert backend.supports_call(*form) is (reason is None)
    reasons = backend.rejection_reasons(*form)
    if reason is None:
        assert reasons == []
    else:
        assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("backend_cls", [CudaBackend, FlashAttnBackend])
def test_rejection_reasons_with_placement_add_the_device_rules(backend_cls):
    if not NO_GPU:
        pytest.skip("CPU-only expectation")
    q, cache, mask, causal, fwd = _paged(page_size=256)
    assert backend_cls().supports_call(q, cache, mask, causal, fwd)
    placed = backend_cls().rejection_reasons(q, cache, mask, causal, fwd, placement=True)
    assert "needs CUDA tensors (got cpu)" in placed
