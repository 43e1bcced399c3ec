"""Nothing lost, nothing silently wrong (issue 47, second round of bad input and faults). One
section per defect, each test first reproducing what used to go wrong; the two-process and
four-process context-parallel cases are in tests/distributed/test_context_parallel_agreement.py
and the memory of a long decode loop in test_cache_memory.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import uuid
import warnings

import pytest
import torch

from astrai.extension import (
    AstraiWarning,
    PagedKVCache,
    attention,
    explain,
    merge_states,
    ops,
)
from astrai.extension.kv_cache import tokens_that_fit
from tests.reference import assert_close_to_reference, paged_reference

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


@pytest.fixture(autouse=True)
def no_environment_backend(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)


def randn(*shape, g):
    return torch.randn(*shape, generator=g)


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


def dense_qkv(seed=0, kv_len=3):
    g = torch.Generator().manual_seed(seed)
    q = randn(1, 3, HEADS, HEAD_DIM, g=g)
    return q, randn(1, kv_len, KV_HEADS, HEAD_DIM, g=g), randn(1, kv_len, KV_HEADS, HEAD_DIM, g=g)


def run_python(code: str, **environment) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on this checkout (settings read once per process start
    empty there)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTR_")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.update(environment)
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )


# -- 1. writes into a cache never carry autograd history ------------------------------------


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def projected_kv(tokens, g, device="cpu"):
    """k and v [tokens, KV_HEADS, HEAD_DIM] from a Linear outside torch.no_grad(), as in a
    model's inference loop: both require grad."""
    projection = torch.nn.Linear(16, 2 * KV_HEADS * HEAD_DIM, device=device)
    x = randn(tokens, 16, g=g).to(device)
    kv = projection(x).view(tokens, 2, KV_HEADS, HEAD_DIM)
    return kv[:, 0], kv[:, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_appending_k_and_v_that_require_grad_stores_values_without_history(device):
    """The pools used to become part of the graph (CopySlices), linking every step to the
    previous one's graph, which then stayed alive."""
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, 4, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32, device=device)
    cache.begin_step([0], [3])
    k, v = projected_kv(3, g, device)
    assert k.requires_grad and v.requires_grad
    versions = [p._version for p in cache.layer(0)]
    cache.append(0, k, v)
    k_pool, v_pool = cache.layer(0)
    for pool in (k_pool, v_pool):
        assert not pool.requires_grad and pool.grad_fn is None
    slots = cache.step.slot_mapping.long()
    assert torch.equal(k_pool.view(-1, KV_HEADS, HEAD_DIM)[slots], k.detach())
    assert torch.equal(v_pool.view(-1, KV_HEADS, HEAD_DIM)[slots], v.detach())
    # The write is still seen by autograd's version counters (a graph that saved a pool).
    assert [p._version for p in cache.layer(0)] > versions


def test_the_op_itself_never_records_history_either():
    g = torch.Generator().manual_seed(2)
    k, v = projected_kv(2, g)
    k_pool = torch.zeros(2, 2, KV_HEADS, HEAD_DIM)
    v_pool = torch.zeros(2, 2, KV_HEADS, HEAD_DIM)
    torch.ops.astr.append_kv(k, v, k_pool, v_pool, int32(3, 0))
    assert k_pool.grad_fn is None and v_pool.grad_fn is None
    assert torch.equal(k_pool.view(-1, KV_HEADS, HEAD_DIM)[[3, 0]], k.detach())


def test_attention_over_the_cache_stays_differentiable_in_q():
    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 4, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    cache.begin_step([0], [3])
    k, v = projected_kv(3, g)
    q = randn(1, 3, HEADS, HEAD_DIM, g=g).requires_grad_()
    out = attention(q, k[None], v[None], kv_cache=cache, is_causal=True, fwd="prefill")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_pool_that_requires_grad_is_refused_by_name():
    """It used to fail inside index_copy_ with a message naming no argument."""
    k_pool = torch.zeros(2, 2, KV_HEADS, HEAD_DIM, requires_grad=True)
    v_pool = torch.zeros(2, 2, KV_HEADS, HEAD_DIM)
    k = torch.randn(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="^k_cache: a pool that requires grad"):
        torch.ops.astr.append_kv(k, k, k_pool, v_pool, int32(0))
    assert not v_pool.any()


# -- 6. bad query_start_loc never gives finite numbers, compiled or not -----------------------


def prefill_batch(seed=4):
    """Two sequences with cached prefixes (5 + 3 new tokens, 2 + 4 new) in a float32 cache."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 8, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    cache.begin_step([0, 1], [5, 2])
    cache.append(0, randn(7, KV_HEADS, HEAD_DIM, g=g), randn(7, KV_HEADS, HEAD_DIM, g=g))
    step = cache.begin_step([0, 1], [3, 4])
    cache.append(0, randn(7, KV_HEADS, HEAD_DIM, g=g), randn(7, KV_HEADS, HEAD_DIM, g=g))
    k_pool, v_pool = cache.layer(0)
    q = randn(7, HEADS, HEAD_DIM, g=g)
    return q, k_pool, v_pool, step


def compiled_torch_native(q, k_pool, v_pool, table, lens, starts):
    """The paged op compiled (AOTAutograd traces it on fake tensors: no host checks), run on
    real tensors."""

    def call(q, k_pool, v_pool, table, lens, starts):
        return torch.ops.astr.attention(
            q,
            k_cache=k_pool,
            v_cache=v_pool,
            block_table=table,
            seq_lens=lens,
            query_start_loc=starts,
            max_query_len=4,
            mode="prefill",
            is_causal=True,
            backend="torch_native",
        )

    torch._dynamo.reset()
    return torch.compile(call, backend="aot_eager", fullgraph=True)(
        q, k_pool, v_pool, table, lens, starts
    )


def test_compiled_torch_native_control_good_metadata_matches_the_reference():
    q, k_pool, v_pool, step = prefill_batch()
    out = compiled_torch_native(
        q, k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc
    )
    ref = paged_reference(
        q, k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc, is_causal=True
    )
    assert_close_to_reference(out, ref)


@pytest.mark.parametrize(
    "starts",
    [[1, 3, 7], [0, 3, 6], [0, 3, 8], [-1, 3, 7]],
    ids=["first=1", "last<T", "last>T", "first<0"],
)
def test_compiled_torch_native_with_query_start_loc_not_from_0_to_t_gives_nan_rows(starts):
    """query_start_loc[0] != 0 or [B] != T used to give finite wrong rows when compiled."""
    q, k_pool, v_pool, step = prefill_batch()
    out = compiled_torch_native(q, k_pool, v_pool, step.block_table, step.seq_lens, int32(*starts))
    assert torch.isnan(out).all()
    with pytest.raises(RuntimeError, match="^query_start_loc: "):  # eager: checked on the host
        torch.ops.astr.attention(
            q,
            k_cache=k_pool,
            v_cache=v_pool,
            block_table=step.block_table,
            seq_lens=step.seq_lens,
            query_start_loc=int32(*starts),
            max_query_len=4,
            mode="prefill",
            is_causal=True,
        )


# -- 7. dense attention over zero keys, with any variant ---------------------------------------

VARIANTS = {
    "softcap": dict(softcap=5.0),
    "window": dict(is_causal=True, window_left=2),
    "lse": dict(return_lse=True),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_attention_over_zero_keys_gives_zeros_and_the_empty_lse(variant):
    """It used to raise IndexError (max over an empty dimension): an empty split's call."""
    q, k, v = dense_qkv(kv_len=0)
    out, lse = attention(q, k, v, **{**VARIANTS[variant], "return_lse": True})
    assert torch.equal(out, torch.zeros_like(out))
    sinks = VARIANTS[variant].get("sinks")
    expected = sinks.view(1, 1, HEADS).expand_as(lse) if sinks is not None else None
    if expected is None:
        assert torch.equal(lse, torch.full_like(lse, -math.inf))
    else:
        torch.testing.assert_close(lse, expected)  # the sink alone: log(exp(sink))


# -- 8. warnings: their own category, the caller's line, once only when given -----------------


def unknown_environment_backend(monkeypatch) -> str:
    value = f"no-such-backend-{uuid.uuid4().hex[:8]}"  # warned once per process per value
    monkeypatch.setenv("ASTR_BACKEND", value)
    return value


@pytest.mark.parametrize("entry", ["python_api", "op"])
def test_warnings_have_astrais_category_and_point_at_the_callers_line(monkeypatch, entry):
    """They were UserWarnings attributed to torch/_ops.py."""
    value = unknown_environment_backend(monkeypatch)
    q, k, v = dense_qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if entry == "python_api":
            attention(q, k, v)
        else:
            torch.ops.astr.attention(q, k, v)
    mine = [w for w in caught if value in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert mine[0].category is AstraiWarning and issubclass(AstraiWarning, UserWarning)
    assert mine[0].filename == __file__


def test_a_once_only_warning_turned_into_an_error_raises_again_next_time(monkeypatch):
    """Under simplefilter("error") the first call raised and every later one ran silently."""
    value = unknown_environment_backend(monkeypatch)
    q, k, v = dense_qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with pytest.raises(RuntimeError, match=f"AstraiWarning .*{value}' is not a backend"):
                attention(q, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention(q, k, v)  # given now, once
        attention(q, k, v)
    assert len([w for w in caught if value in str(w.message)]) == 1


def test_a_fallback_warning_turned_into_an_error_raises_again_next_time():
    """ASTR_BACKEND=cuda where cuda cannot run: the fallback warns once per process (a fresh
    one here); under simplefilter("error") only the first call raised."""
    if torch.cuda.is_available():
        pytest.skip("the cuda backend may run here")
    process = run_python(
        """
        import os, warnings, torch
        os.environ["ASTR_BACKEND"] = "cuda"
        from astrai.extension import attention
        q = torch.randn(1, 3, 2, 8)
        raised = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                try:
                    attention(q, q, q)
                except RuntimeError as error:
                    raised += "AstraiWarning" in str(error)
        print(raised)
        """
    )
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-2000:]
    assert stdout.strip() == "2"


def test_astrai_warnings_can_be_filtered_by_their_category(monkeypatch):
    value = unknown_environment_backend(monkeypatch)
    q, k, v = dense_qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=AstraiWarning)
        attention(q, k, v)
    assert not [w for w in caught if value in str(w.message)]


# -- 9. a scale or softcap beyond float32's range ---------------------------------------------


@pytest.mark.parametrize(
    "name, value", [("scale", 1e39), ("scale", -1e39), ("softcap", 1e39), ("softcap", 1e-45)]
)
def test_a_scale_or_softcap_float32_cannot_hold_is_refused_by_name(name, value):
    """1e39 passed the isfinite check on the double and made every output NaN."""
    q, k, v = dense_qkv()
    with pytest.raises(ValueError, match=f"^{name}: expected .*float32"):
        attention(q, k, v, **{name: value})
    with pytest.raises(ValueError, match=f"^{name}: expected .*float32"):
        explain(q, k, v, **{name: value})


@pytest.mark.parametrize("name, value", [("scale", 1e30), ("softcap", 1e-30)])
def test_control_a_scale_or_softcap_within_float32_runs(name, value):
    q, k, v = dense_qkv()
    assert not torch.isnan(attention(q, k, v, **{name: value})).any()


# -- 10. merge_states never reads a side that saw nothing -------------------------------------


def partial_attention(seed):
    g = torch.Generator().manual_seed(seed)
    return randn(3, HEADS, HEAD_DIM, g=g), randn(3, HEADS, g=g)


def test_merging_with_an_empty_side_holding_garbage_returns_the_other_side():
    """lse -inf weighs 0, but 0 x NaN made the merge NaN."""
    out_a, lse_a = partial_attention(5)
    out_b = torch.full_like(out_a, float("nan"))
    out_b[1] = 1e30
    lse_b = torch.full_like(lse_a, -math.inf)
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = merge_states(out_b, lse_b, out_a, lse_a)  # either side
    torch.testing.assert_close(out, out_a)


def test_merging_where_one_side_has_lse_plus_inf_takes_that_side():
    """It gave NaN (inf / inf)."""
    out_a, lse_a = partial_attention(6)
    out_b, lse_b = partial_attention(7)
    lse_b[0, 1] = math.inf
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0, 1], out_b[0, 1]) and lse[0, 1] == math.inf
    mask = torch.ones_like(lse, dtype=torch.bool)
    mask[0, 1] = False
    assert torch.isfinite(out).all() and torch.isfinite(lse[mask]).all()


def test_merge_states_gradients_stay_finite_next_to_an_empty_side():
    out_a, lse_a = partial_attention(8)
    out_a.requires_grad_()
    lse_a.requires_grad_()
    out_b = torch.full_like(out_a, float("nan"))
    lse_b = torch.full_like(lse_a, -math.inf).requires_grad_()
    out, lse = merge_states(out_a, lse_a, out_b, lse_b)
    (out.sum() + lse.sum()).backward()
    assert torch.isfinite(out_a.grad).all() and torch.isfinite(lse_a.grad).all()


# -- 11. control characters in a backend's reason ---------------------------------------------


CONTROL_REASON = "import failed:\tlibfoo.so\x1b[31m (red)\x1b[0m\x7f\x01\nsecond line"


@pytest.fixture
def flash_status_with_control_characters():
    """flash marked unavailable for a reason full of control characters, restored after."""
    q, k, v = dense_qkv()
    explain(q, k, v)  # the flash probe runs once; it must not overwrite the status below
    before = torch.ops.astr.backend_status("flash")
    ops.set_backend_status("flash", False, CONTROL_REASON)
    yield
    saved = json.loads(before, strict=False)
    ops.set_backend_status("flash", saved["available"], saved["reason"], saved["version"])


def test_explain_escapes_control_characters_in_a_reason(flash_status_with_control_characters):
    """explain() used to fail with a JSON error."""
    q, k, v = dense_qkv()
    decision = explain(q, k, v)
    assert CONTROL_REASON in decision.rejected["flash"]


def test_backend_status_escapes_control_characters_in_a_reason(
    flash_status_with_control_characters,
):
    assert ops.backend_status("flash")["reason"] == CONTROL_REASON


# -- 12. pools of 2^31 slots or more ----------------------------------------------------------


def test_a_cache_of_2_31_slots_is_refused_at_construction_naming_its_size():
    """begin_step cast the slots to int32: the wrapped negative slots were skipped, and those
    tokens never written. (Meta tensors: nothing is allocated.)"""
    with pytest.raises(ValueError, match=r"^num_pages: 134217728 pages of 16 slots .* 2147483648"):
        PagedKVCache(1, 2**27, 16, 1, 8, device="meta")


def test_append_kv_refuses_a_pool_an_int32_slot_mapping_cannot_address():
    pool = torch.empty(2**27, 16, 1, 8, device="meta")
    k = torch.empty(1, 1, 8, device="meta")
    with pytest.raises(RuntimeError, match=r"^k_cache: a pool of 2147483648 slots"):
        torch.ops.astr.append_kv(
            k, k, pool, pool.clone(), torch.zeros(1, dtype=torch.int32, device="meta")
        )


# -- 13. the smaller ones ---------------------------------------------------------------------


def fp8_cache():
    return PagedKVCache(1, 4, 4, KV_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn)


BAD_SCALES = {"zero": 0.0, "negative": -1.0, "nan": float("nan"), "inf": float("inf")}


@pytest.mark.parametrize("bad", list(BAD_SCALES))
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_the_ops_refuse_fp8_scales_that_are_not_positive_and_finite(bad, name):
    """Only PagedKVCache.set_scales checked them; the ops stored inf or read NaN silently."""
    cache = fp8_cache()
    step = cache.begin_step([0], [2])
    k_pool, v_pool = cache.layer(0)
    scales = {"k_scale": torch.ones(KV_HEADS), "v_scale": torch.ones(KV_HEADS)}
    scales[name][1] = BAD_SCALES[bad]
    k = torch.randn(2, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    before = k_pool.view(torch.uint8).clone(), v_pool.view(torch.uint8).clone()
    with pytest.raises(ValueError, match=f"^{name}: expected positive finite FP8 scales"):
        torch.ops.astr.append_kv(k, k, k_pool, v_pool, step.slot_mapping, **scales)
    assert torch.equal(k_pool.view(torch.uint8), before[0])
    assert torch.equal(v_pool.view(torch.uint8), before[1])
    with pytest.raises(ValueError, match=f"^{name}: expected positive finite FP8 scales"):
        torch.ops.astr.attention(
            torch.randn(2, HEADS, HEAD_DIM, dtype=torch.bfloat16),
            k_cache=k_pool,
            v_cache=v_pool,
            block_table=step.block_table,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            max_query_len=2,
            mode="prefill",
            **scales,
        )


@pytest.mark.cuda
def test_the_cuda_append_refuses_bad_scales_and_repeated_slots_in_checked_mode():
    """On a GPU reading them back is a synchronisation: the checked mode's."""
    head_dim = 16  # an FP8 row of 16 bytes, as the cuda append copies
    cache = PagedKVCache(1, 4, 16, KV_HEADS, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
    cache.begin_step([0], [2])
    k_pool, v_pool = cache.layer(0)
    k = torch.randn(2, KV_HEADS, head_dim, dtype=torch.bfloat16, device="cuda")
    bad = torch.tensor([1.0, 0.0], device="cuda")
    ops.set_metadata_checks(True)
    try:
        with pytest.raises(ValueError, match="^k_scale: expected positive finite FP8 scales"):
            torch.ops.astr.append_kv(k, k, k_pool, v_pool, cache.step.slot_mapping, bad, bad)
        twice = torch.tensor([3, 3], dtype=torch.int32, device="cuda")
        with pytest.raises(RuntimeError, match="^slot_mapping: slot 3 appears twice"):
            torch.ops.astr.append_kv(k, k, k_pool, v_pool, twice, *cache.scales(0))
    finally:
        ops.set_metadata_checks(False)
    assert not k_pool.view(torch.uint8).any()


def test_append_kv_refuses_a_slot_written_twice():
    k_pool, v_pool = torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8)
    k = torch.randn(3, 1, 8)
    with pytest.raises(
        RuntimeError, match=r"^slot_mapping: slot 2 appears twice \(tokens 0 and 2\)"
    ):
        torch.ops.astr.append_kv(k, k, k_pool, v_pool, int32(2, 1, 2))
    assert not k_pool.any() and not v_pool.any()
    torch.ops.astr.append_kv(k, k, k_pool, v_pool, int32(-1, 1, -1))  # skipped slots may repeat


def test_append_kv_refuses_one_tensor_as_both_pools():
    pool = torch.zeros(2, 2, 1, 8)
    k = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="^v_cache: the same tensor as k_cache"):
        torch.ops.astr.append_kv(k, k, pool, pool, int32(0))
    with pytest.raises(RuntimeError, match="^v_cache: the same memory as k_cache"):
        torch.ops.astr.append_kv(k, k, pool, pool.view(2, 2, 1, 8), int32(0))
    assert not pool.any()
    both = torch.zeros(2, 2, 2, 1, 8)  # control: K and V as two halves of one allocation
    torch.ops.astr.append_kv(k, 2 * k, both[0], both[1], int32(3))
    assert torch.equal(both[1].view(-1, 1, 8)[3], 2 * k[0])
    # control: views whose spans overlap but whose used pages do not (transformers' layout: V
    # page b is K page b + 1, block ids step by 2)
    flat = torch.zeros(5 * 2 * 8)
    k_pages = flat[: 4 * 16].view(4, 2, 1, 8)
    v_pages = flat[16:].view(4, 2, 1, 8)
    torch.ops.astr.append_kv(k, 2 * k, k_pages, v_pages, int32(1))
    assert torch.equal(k_pages[0, 1], k[0]) and torch.equal(v_pages[0, 1], 2 * k[0])


def test_attention_over_a_cache_with_v_none_names_v():
    """It raised AttributeError ('NoneType' object has no attribute 'dim')."""
    cache = PagedKVCache(1, 4, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    cache.begin_step([0], [1])
    q, k = torch.randn(1, 1, HEADS, HEAD_DIM), torch.randn(1, 1, KV_HEADS, HEAD_DIM)
    with pytest.raises(TypeError, match="^v: expected a tensor"):
        attention(q, k, None, kv_cache=cache, fwd="decode")


def test_begin_step_keys_tensor_ids_by_value():
    """torch.tensor([0, 1]) ids were keyed by tensor identity: every step started new
    sequences."""
    cache = PagedKVCache(1, 8, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    cache.begin_step(torch.tensor([0, 1]), [3, 2])
    cache.begin_step(torch.tensor([0, 1]), torch.tensor([1, 1]))
    assert [cache.seq_len(0), cache.seq_len(1)] == [4, 3]
    assert cache.seq_len(torch.tensor(0)) == 4
    with pytest.raises(TypeError, match="^seq_ids: expected integer ids"):
        cache.begin_step(torch.tensor([0.0]), [1])


def test_scales_from_refuses_a_head_holding_nan():
    """A NaN head's scale was set to 1.0."""
    cache = fp8_cache()
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    k[1, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"^k: kv heads \[1\] hold NaN or inf"):
        cache.scales_from(0, k, torch.randn(3, KV_HEADS, HEAD_DIM))
    assert torch.equal(cache.k_scales[0], torch.ones(KV_HEADS))


def test_scales_from_checks_the_shape_of_k_and_v():
    """Tokens of the wrong head count were reshaped into the cache's heads silently."""
    cache = fp8_cache()
    with pytest.raises(ValueError, match=r"^v: expected \[\.\.\., kv_heads=2, head_dim=8\]"):
        cache.scales_from(0, torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, 1, 2 * HEAD_DIM))


def test_set_scales_with_a_tensor_that_requires_grad_stores_its_value():
    """Later outputs all required grad."""
    cache = fp8_cache()
    scale = torch.full((KV_HEADS,), 0.5, requires_grad=True)
    cache.set_scales(0, scale, scale * 2)
    assert not cache.k_scales[0].requires_grad and not cache.v_scales[0].requires_grad
    assert torch.equal(cache.v_scales[0], torch.ones(KV_HEADS))
    cache.begin_step([0], [1])
    q = torch.randn(1, 1, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    assert not attention(q, kv, kv, kv_cache=cache, fwd="decode").requires_grad


CHECK_METADATA = """
    import torch
    from astrai.extension import ops  # noqa
    print(torch.ops.astr.metadata_checks())
"""


def test_astr_check_metadata_accepts_the_usual_spellings_and_refuses_the_rest():
    """Only '1' turned the checks on; 'true' and 'yes' were silently ignored."""
    values = {"TRUE": True, "on": True, "No": False, "maybe": None}  # a process each
    runs = {value: run_python(CHECK_METADATA, ASTR_CHECK_METADATA=value) for value in values}
    for value, expected in values.items():
        stdout, stderr = runs[value].communicate(timeout=300)
        if expected is None:
            assert runs[value].returncode != 0
            assert "ASTR_CHECK_METADATA: expected 1, true, yes or on" in stderr
            assert "got 'maybe'" in stderr
        else:
            assert runs[value].returncode == 0, stderr[-2000:]
            assert stdout.strip() == str(expected), value


# Errors that named no argument (or the wrong one).
NAMELESS = {
    "layer_id=1.5": (lambda c: c.layer(1.5), TypeError, "^layer_id: expected an integer"),
    "layer_id='0'": (lambda c: c.layer("0"), TypeError, "^layer_id: expected an integer"),
    "append layer_id=1.5": (
        lambda c: c.append(1.5, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)),
        TypeError,
        "^layer_id: expected an integer",
    ),
    "append k=list": (
        lambda c: c.append(0, [0.0], torch.zeros(1, 1, 8)),
        TypeError,
        "^k: expected a tensor",
    ),
    "num_pages=2.5": (
        lambda c: PagedKVCache(1, 2.5, 4, 1, 8),
        TypeError,
        "^num_pages: expected an integer",
    ),
    "page_size=16.0": (
        lambda c: PagedKVCache(1, 4, 16.0, 1, 8),
        TypeError,
        "^page_size: expected an integer",
    ),
    "num_kv_heads=0": (
        lambda c: PagedKVCache(1, 4, 4, 0, 8),
        ValueError,
        "^num_kv_heads: expected a positive",
    ),
    "head_dim_v=0": (
        lambda c: PagedKVCache(1, 4, 4, 1, 8, head_dim_v=0),
        ValueError,
        "^head_dim_v: expected a positive",
    ),
    "dtype=int32": (
        lambda c: PagedKVCache(1, 4, 4, 1, 8, dtype=torch.int32),
        TypeError,
        "^dtype: expected a floating-point",
    ),
    "set_scales 'a'": (
        lambda c: fp8_cache().set_scales(0, "a", 1.0),
        TypeError,
        "^k_scale: expected a float",
    ),
    "tokens_that_fit num_layers=0": (
        lambda c: tokens_that_fit(1 << 30, 0, 8, 128, torch.bfloat16),
        ValueError,
        "^num_layers: expected a positive integer",
    ),
    "tokens_that_fit memory_bytes=-1": (
        lambda c: tokens_that_fit(-1, 1, 8, 128, torch.bfloat16),
        ValueError,
        "^memory_bytes: expected a count of bytes >= 0",
    ),
    "query_start_loc wrapping int32": (
        lambda c: torch.ops.astr.attention(
            torch.randn(3, 2, 8),
            k_cache=c.k_pools[0],
            v_cache=c.v_pools[0],
            block_table=int32(0, 1).view(2, 1),
            seq_lens=int32(2, 1),
            query_start_loc=int32(0, 2**31 - 1, 3),
            max_query_len=2,
            mode="prefill",
        ),
        RuntimeError,
        r"^query_start_loc: entry 1 is 2147483647, outside \[0, 3\]",
    ),
}


@pytest.mark.parametrize("case", list(NAMELESS))
def test_errors_name_the_argument(case):
    call, error, message = NAMELESS[case]
    cache = PagedKVCache(1, 4, 4, 1, 8, dtype=torch.float32)
    cache.begin_step([0], [1])
    with pytest.raises(error, match=message):
        call(cache)


def test_paged_kv_cache_says_it_is_not_thread_safe():
    assert "Not thread-safe" in PagedKVCache.__doc__
