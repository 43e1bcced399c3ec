"""The flash backend's wiring: the lazy probe, its report, the ops it registers, and the
resolver's use of them. These tests install TEST DOUBLES, computed with SDPA:
tests/doubles/flash_attn_sdpa_double.py (FlashAttention-2's Python signatures) as ``flash_attn``
and tests/doubles/flash_attn_cute_sdpa_double.py (FlashAttention-4's) as ``flash_attn.cute``.
The real package runs the same paths on the device: tests/extension/test_flash_real_package.py."""

import importlib
import sys

import pytest
import torch

import astrai.extension as ae
from astrai.extension import ops
from astrai.extension.backend import flash as flash_module
from tests.doubles import flash_attn_cute_sdpa_double, flash_attn_sdpa_double
from tests.extension.test_numerics import RAGGED_STEPS, PagedRun, assert_matches
from tests.reference import sequence_reference

attention_module = importlib.import_module("astrai.extension.backend.attention")


def reprobe():
    flash_module.probe_flash.cache_clear()
    attention_module._priority_backends.cache_clear()
    attention_module._flash_probed = False
    return flash_module.probe_flash()


def probed_with(monkeypatch, **modules):
    """Probe with these modules in sys.modules (None: importing it fails) for one test."""
    for name in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, modules.get(name.replace(".", "_")))
    yield reprobe()
    monkeypatch.undo()
    reprobe()


@pytest.fixture
def flash_double(monkeypatch):
    """flash-attn (FlashAttention-2) replaced by the SDPA test double, the others absent."""
    yield from probed_with(monkeypatch, flash_attn=flash_attn_sdpa_double)


@pytest.fixture
def flash4_double(monkeypatch):
    """FlashAttention-4 (flash_attn.cute) replaced by its SDPA test double, the others absent."""
    yield from probed_with(monkeypatch, flash_attn_cute=flash_attn_cute_sdpa_double)


@pytest.fixture
def no_flash(monkeypatch):
    yield from probed_with(monkeypatch)


def test_missing_package_is_an_unavailable_reason_not_an_import_error(no_flash):
    assert not no_flash.available
    assert "flash-attn not importable" in no_flash.reason
    assert ops.backend_status("flash") == {
        "available": False,
        "reason": no_flash.reason,
        "version": 0,
    }


def test_broken_package_is_reported_not_raised(monkeypatch):
    def broken_import(name, *args, **kwargs):
        if name.startswith("flash_attn"):
            raise OSError("undefined symbol: _ZN3c10 (broken build)")
        return importlib.__import__(name, *args, **kwargs)

    monkeypatch.setattr(flash_module.importlib, "import_module", broken_import)
    try:
        probe = reprobe()
        assert not probe.available
        assert "OSError: undefined symbol" in probe.reason
    finally:
        monkeypatch.undo()
        reprobe()


def test_explain_lists_the_flash_reason(no_flash):
    q = torch.randn(1, 4, 2, 8)
    decision = ae.explain(q, q, q)
    assert decision.backend == "torch_native"
    assert any("flash-attn not importable" in r for r in decision.rejected["flash"])


def test_info_report_names_the_flash_reason(no_flash):
    from astrai.extension import info

    assert "flash-attn not importable" in info.report()


def test_probe_finds_the_double_as_flash_attention_2(flash_double):
    assert flash_double.available
    assert flash_double.version == 2
    assert "sdpa-test-double" in flash_double.reason
    assert ops.backend_status("flash")["version"] == 2


def test_flash_is_never_chosen_for_cpu_tensors(flash_double):
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    decision = ae.explain(q, q, q)
    assert decision.backend == "torch_native"
    assert "needs CUDA tensors (got cpu)" in decision.rejected["flash"]
    with pytest.raises(RuntimeError, match="Explicitly-set backend 'flash'"):
        ae.attention(q, q, q, backend="flash")


def reference_dense(q, k, v, is_causal, scale):
    return torch.ops.astr.attention(
        q, k, v, is_causal=is_causal, scale=scale, backend="torch_native"
    )


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_dense_op_runs_the_package(flash_double, is_causal):
    torch.manual_seed(0)
    q = torch.randn(2, 16, 4, 32)
    k = torch.randn(2, 16, 2, 32)
    v = torch.randn(2, 16, 2, 32)
    out, _ = torch.ops.astr.flash_dense(q, k, v, is_causal, 0.2)
    torch.testing.assert_close(out, reference_dense(q, k, v, is_causal, 0.2))


def paged_case(device, dtype, page_size=256, seed=0):
    """A ragged batch with cached prefixes, written into a paged cache."""
    torch.manual_seed(seed)
    cache = ae.PagedKVCache(
        1, max(8, 2048 // page_size), page_size, 2, 64, dtype=dtype, device=device
    )
    prompts = [300, 17, 520]
    cache.begin_step([0, 1, 2], prompts)
    total = sum(prompts)
    cache.append(
        0,
        torch.randn(total, 2, 64, dtype=dtype, device=device),
        torch.randn(total, 2, 64, dtype=dtype, device=device),
    )
    new = [5, 1, 40]
    cache.begin_step([0, 1, 2], new)
    q = torch.randn(1, sum(new), 8, 64, dtype=dtype, device=device)
    k = torch.randn(1, sum(new), 2, 64, dtype=dtype, device=device)
    v = torch.randn(1, sum(new), 2, 64, dtype=dtype, device=device)
    return cache, q, k, v


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_paged_op_matches_torch_native(flash_double, is_causal):
    cache, q, k, v = paged_case("cpu", torch.float32)
    cache.append(0, k, v)
    step = cache.step
    k_pool, v_pool = cache.layer(0)
    q3 = q[0]
    args = (
        q3,
        k_pool,
        v_pool,
        step.block_table,
        step.seq_lens,
        step.query_start_loc,
        step.max_query_len,
    )
    out, _ = torch.ops.astr.flash_paged(*args, False, is_causal, 0.125)
    expected = torch.ops.astr.attention(
        q3,
        k_cache=k_pool,
        v_cache=v_pool,
        block_table=step.block_table,
        seq_lens=step.seq_lens,
        query_start_loc=step.query_start_loc,
        max_query_len=step.max_query_len,
        mode="prefill",
        is_causal=is_causal,
        scale=0.125,
        backend="torch_native",
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.cuda
def test_flash_is_the_default_for_training_on_the_gpu(flash_double):
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(2, 64, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for h in (8, 2, 2)
    )
    decision = ae.explain(q, k, v, is_causal=True)
    assert decision.backend == "flash", decision
    out = ae.attention(q, k, v, is_causal=True)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = ae.attention(q, k, v, is_causal=True, backend="torch_native")
    expected.float().square().sum().backward()
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
def test_flash_paged_path_on_the_gpu_matches_torch_native(flash_double):
    cache, q, k, v = paged_case("cuda", torch.bfloat16)
    out = ae.attention(q, k, v, kv_cache=cache, fwd="prefill", is_causal=True, backend="flash")
    expected = ae.attention(
        q, None, None, kv_cache=cache, fwd="prefill", is_causal=True, backend="torch_native"
    )
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_flash_two_fifty_six_rule_sends_small_pages_elsewhere(flash_double):
    cache, q, k, v = paged_case("cuda", torch.bfloat16, page_size=16)
    decision = ae.explain(q, kv_cache=cache, fwd="prefill", is_causal=True)
    assert "multiple of 256" in " ".join(decision.rejected["flash"])
    assert decision.backend != "flash"


# -- FlashAttention-4: its functions are not torch ops, so astr's flash ops are opaque kernels --


def test_probe_finds_the_flash4_double_as_flash_attention_4(flash4_double):
    assert flash4_double.available
    assert flash4_double.version == 4
    assert flash4_double.module == "flash_attn.cute"
    assert "sdpa-test-double" in flash4_double.reason


def test_probe_prefers_flash4_over_flash2_when_both_import(monkeypatch):
    probes = probed_with(
        monkeypatch, flash_attn=flash_attn_sdpa_double, flash_attn_cute=flash_attn_cute_sdpa_double
    )
    try:
        assert next(probes).version == 4
    finally:
        next(probes, None)  # restores sys.modules and the probe


def flash4_dense_inputs(requires_grad=False):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 24, h, 32, generator=g) for h in (6, 2, 2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash4_dense_op_runs_the_package_and_differentiates(flash4_double, is_causal):
    q, k, v = flash4_dense_inputs(requires_grad=True)
    before = flash_attn_cute_sdpa_double.calls["dense"]
    out, _ = torch.ops.astr.flash_dense(q, k, v, is_causal, 0.3)
    assert flash_attn_cute_sdpa_double.calls["dense"] == before + 1
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
    expected = torch.ops.astr.attention(
        q2, k2, v2, is_causal=is_causal, scale=0.3, backend="torch_native"
    )
    (expected * weights).sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash4_paged_steps_match_definition(flash4_double, page_size, is_causal):
    """Any page size (FlashAttention-4 has no 256-token rule); prefill and decode steps."""
    run = PagedRun(page_size, 8, 2, 32, torch.float32, seed=page_size, steps=RAGGED_STEPS)
    calls = dict(flash_attn_cute_sdpa_double.calls)
    for new_tokens in RAGGED_STEPS:
        # flash never takes CPU tensors through the resolver: call the op the backend calls
        step = run.cache.begin_step(list(new_tokens), list(new_tokens.values()))
        tokens = sum(new_tokens.values())
        q = torch.randn(tokens, 8, 32, generator=run.g)
        k = torch.randn(tokens, 2, 32, generator=run.g)
        v = torch.randn(tokens, 2, 32, generator=run.g)
        run.cache.append(0, k, v)
        k_pool, v_pool = run.cache.layer(0)
        out, _ = torch.ops.astr.flash_paged(
            q,
            k_pool,
            v_pool,
            step.block_table,
            step.seq_lens,
            step.query_start_loc,
            step.max_query_len,
            step.mode == "decode",
            is_causal,
            0.25,
        )
        start = 0
        for seq, new in new_tokens.items():
            rows = slice(start, start + new)
            run.keys[seq] = torch.cat([run.keys.get(seq, k[:0]), k[rows]])
            run.values[seq] = torch.cat([run.values.get(seq, v[:0]), v[rows]])
            ref = sequence_reference(
                q[rows], run.keys[seq], run.values[seq], is_causal=is_causal, scale=0.25
            )
            assert_matches(out[rows], ref)
            start += new
    assert flash_attn_cute_sdpa_double.calls["varlen"] == calls["varlen"] + len(RAGGED_STEPS)


def test_flash4_ops_pass_opcheck(flash4_double):
    q, k, v = flash4_dense_inputs(requires_grad=True)
    torch.library.opcheck(torch.ops.astr.flash_dense.default, (q, k, v, True, 0.3))
    cache, q, k, v = paged_case("cpu", torch.float32, page_size=16)
    cache.append(0, k, v)
    step = cache.step
    k_pool, v_pool = cache.layer(0)
    args = (q[0], k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc)
    torch.library.opcheck(
        torch.ops.astr.flash_paged.default, (*args, step.max_query_len, False, True, 0.125)
    )


def test_flash4_dense_stays_one_node_in_a_compiled_graph(flash4_double):
    """The package's Python is not traced: the graph holds astr::flash_dense, forward and
    backward (through flash_dense_backward) compile with fullgraph and match eager."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    recorder = AotEagerAndRecordGraphs()

    @torch.compile(backend=recorder, fullgraph=True)
    def step(q, k, v):
        return torch.ops.astr.flash_dense(q, k, v, True, 0.3)[0].square().sum()

    q, k, v = flash4_dense_inputs(requires_grad=True)
    step(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.ops.astr.flash_dense(q, k, v, True, 0.3)[0].square().sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)
    forward_code = recorder.fw_graphs[0].code
    backward_code = recorder.bw_graphs[0].code
    assert "astr.flash_dense.default" in forward_code
    assert "astr.flash_dense_backward.default" in backward_code


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash4_dense_op_takes_unequal_qk_and_v_head_dims(flash4_double, is_causal):
    """DeepSeek's MHA form, (192, 128): v's head dim reaches the package as it is and shapes
    the output (the capability rules let FlashAttention-3/4 take it: resolver_test.cpp)."""
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 12, h, 192, generator=g) for h in (4, 2))
    v = torch.randn(1, 12, 2, 128, generator=g)
    out, _ = torch.ops.astr.flash_dense(q, k, v, is_causal, 0.07)
    assert out.shape == (1, 12, 4, 128)
    expected = torch.ops.astr.attention(
        q, k, v, is_causal=is_causal, scale=0.07, backend="torch_native"
    )
    torch.testing.assert_close(out, expected)
