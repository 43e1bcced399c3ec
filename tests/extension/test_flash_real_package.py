"""The flash backend against a real flash-attn package (FlashAttention-2, -3 or -4), on the GPU.

Skipped where no real package imports (CI has none; the device gets FlashAttention-4 carried
as wheels, see scripts/flash_wheels.sh). Every result is compared with the float64 reference
from the definition on fresh random inputs, outputs poisoned first.
"""

import importlib

import pytest
import torch

import astrai.extension as ae
from astrai.extension.backend import flash as flash_module
from tests.extension.test_numerics import RAGGED_STEPS, PagedRun, assert_matches
from tests.reference import dense_reference

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def real_flash():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    flash_module.probe_flash.cache_clear()
    importlib.import_module("astrai.extension.backend.attention")._priority_backends.cache_clear()
    probe = flash_module.probe_flash()
    if not probe.available or "test-double" in probe.reason:
        pytest.skip(f"no real flash-attn package: {probe.reason}")
    return probe


def relative_l2(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_dense_forward_and_backward_match_the_definition(real_flash, is_causal):
    g = torch.Generator().manual_seed(11)
    shapes = [(2, 256, h, 128) for h in (16, 4, 4)]  # GQA 4
    q, k, v = (torch.randn(*s, generator=g).to("cuda", torch.bfloat16) for s in shapes)
    assert ae.explain(q, k, v, is_causal=is_causal).backend == "flash"  # the default, too
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ae.attention(*leaves, is_causal=is_causal, backend="flash")
    weights = torch.randn(out.shape, generator=g).to("cuda", torch.bfloat16)
    (out.float() * weights.float()).sum().backward()

    reference_leaves = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, v)]
    reference = dense_reference(*reference_leaves, is_causal=is_causal)
    (reference * weights.cpu().double()).sum().backward()
    assert_matches(out.detach().cpu(), reference.detach())
    for leaf, reference_leaf in zip(leaves, reference_leaves):
        assert torch.isfinite(leaf.grad).all()
        assert relative_l2(leaf.grad.cpu(), reference_leaf.grad) < 3e-2


@pytest.mark.parametrize("page_size", [16, 128])
def test_paged_prefill_and_decode_steps_match_the_definition(real_flash, page_size):
    steps = RAGGED_STEPS + [{0: 300, 1: 40}, {0: 1, 1: 1}]
    run = PagedRun(
        page_size,
        16,
        4,
        128,
        torch.bfloat16,
        seed=page_size,
        steps=steps,
        device="cuda",
        backend="flash",
    )
    for new_tokens in steps:
        out, ref = run.step(new_tokens, is_causal=True)
        assert_matches(out, ref)


def test_compiled_decode_keeps_flash_in_one_graph(real_flash):
    from torch._dynamo.testing import CompileCounterWithBackend

    steps = [{0: 37, 1: 5}] + [{0: 1, 1: 1}] * 3
    run = PagedRun(
        16, 16, 4, 128, torch.bfloat16, seed=3, steps=steps, device="cuda", backend="flash"
    )
    run.step(steps[0], is_causal=True)
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def decode(q, k, v, cache):
        return ae.attention(q, k, v, kv_cache=cache, fwd="decode", is_causal=True, backend="flash")

    g = torch.Generator().manual_seed(8)
    for _ in steps[1:]:
        run.cache.begin_step([0, 1], [1, 1])
        q, k, v = (
            torch.randn(2, 1, h, 128, generator=g).to("cuda", torch.bfloat16) for h in (16, 4, 4)
        )
        got = torch.full_like(q, float("nan"))
        got.copy_(decode(q, k, v, run.cache))
        pools = [p.clone() for p in run.cache.layer(0)]
        # The same step eagerly: the append writes the same slots again, the output must agree.
        want = ae.attention(
            q, k, v, kv_cache=run.cache, fwd="decode", is_causal=True, backend="flash"
        )
        torch.testing.assert_close(got, want)
        for compiled_pool, eager_pool in zip(pools, run.cache.layer(0)):
            torch.testing.assert_close(compiled_pool, eager_pool, atol=0, rtol=0)
    assert counter.frame_count == 1


def test_opcheck_on_the_real_package(real_flash):
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 128, h, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
        for h in (8, 2, 2)
    )
    torch.library.opcheck(
        torch.ops.astr.flash_dense.default,
        (q, k, v, True, 0.125),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
