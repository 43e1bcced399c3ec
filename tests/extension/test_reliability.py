"""Bad input never crashes, leaks or writes half a result; every failed call changes nothing
(issue 28). One section per finding, each test first reproducing what used to go wrong.

Bad tensors raise RuntimeError and bad names or options ValueError, with a message that starts
with the argument's name (as in test_bad_input.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import uuid
import warnings

import pytest
import torch

from astrai.extension import (
    KVCacheFullError,
    PagedKVCache,
    TorchNativeBackend,
    attention,
    attn_backend,
    explain,
    get_backend,
)
from astrai.extension.backend.attention import _priority_backends
from astrai.extension.backend.cuda import CudaBackend
from astrai.extension.backend.flash import FlashAttnBackend
from astrai.extension.selection import THREAD_CONTEXTS
from tests.reference import assert_close_to_reference, dense_reference, paged_reference

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


@pytest.fixture(autouse=True)
def no_environment_backend(monkeypatch):
    """Tests start without ASTR_BACKEND and must leave no context behind."""
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    yield
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    assert torch.ops.astr.selected_backend() == ("", 4)
    assert THREAD_CONTEXTS.entries == []


def randn(*shape, g):
    return torch.randn(*shape, generator=g)


def int32(*values):
    return torch.tensor(values, dtype=torch.int32)


def dense_qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(randn(1, 3, HEADS, HEAD_DIM, g=g) for _ in range(3))


def run_python(code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter that imports this checkout's astrai (a crash there
    cannot take the test session down, and process-wide once-only state starts empty)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "ASTR_BACKEND"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )


# -- 1. a selection naming no backend crashed the interpreter -------------------------------


def test_a_selection_naming_no_backend_raises_instead_of_crashing():
    """A context selection naming no backend (``"nope"``, ``""``) used to dereference an empty
    parse in the resolver (SIGSEGV). Run in a child process, so a crash fails this test, not the
    session."""
    result = run_python(
        """
        import torch, astrai.extension
        q = torch.randn(1, 3, 2, 8)
        for name in ("nope", ""):
            for op in (torch.ops.astr.attention, torch.ops.astr.explain):
                try:
                    op(q, q, q, backend=name, backend_source=2)
                except ValueError as error:
                    print(type(error).__name__, str(error).splitlines()[0])
                else:
                    print("no error")
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 4, result.stdout
    for line, name in zip(lines, ["nope"] * 2 + [""] * 2):
        assert line.startswith(
            f"ValueError backend: '{name}' (backend_source 2, a context) names"
        ), line
        assert "cuda, flash, torch_native" in line


@pytest.mark.parametrize(
    "backend, source", [("torch_native", 2), ("torch_native", 3), (None, 4), ("torch_native", 1)]
)
def test_a_well_formed_selection_still_runs(backend, source):
    q, k, v = dense_qkv()
    out = torch.ops.astr.attention(q, k, v, backend=backend, backend_source=source)
    torch.testing.assert_close(out, attention(q, k, v, backend="torch_native"))


# -- 3. append_kv: nothing written on meta, half a write with a small v_cache ----------------


def append_args(seed=0):
    """Three tokens into a pool of 4 pages of 2 slots (zeros, so any write shows)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        k=randn(3, KV_HEADS, HEAD_DIM, g=g),
        v=randn(3, KV_HEADS, HEAD_DIM, g=g),
        k_cache=torch.zeros(4, 2, KV_HEADS, HEAD_DIM),
        v_cache=torch.zeros(4, 2, KV_HEADS, HEAD_DIM),
        slot_mapping=int32(5, 0, 3),
    )


def meta_like(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@pytest.mark.parametrize("name", ["v", "k_cache", "v_cache", "slot_mapping"])
def test_append_kv_with_one_argument_on_meta_raises_and_writes_nothing(name):
    """The Meta kernel used to win dispatch and return having written nothing, silently."""
    args = append_args()
    args[name] = meta_like(args[name])
    with pytest.raises(RuntimeError, match=rf"^{name}: expected a tensor on cpu \(the device of k"):
        torch.ops.astr.append_kv(**args)
    for pool in ("k_cache", "v_cache"):
        if args[pool].device.type == "cpu":
            assert not args[pool].any()


def test_append_kv_with_k_on_meta_and_the_rest_on_cpu_raises():
    args = append_args()
    args["k"] = meta_like(args["k"])
    with pytest.raises(RuntimeError, match=r"^v: expected a tensor on meta \(the device of k"):
        torch.ops.astr.append_kv(**args)
    assert not args["k_cache"].any() and not args["v_cache"].any()


def test_append_kv_all_on_meta_checks_shapes_and_writes_nothing():
    """All on meta is shape propagation: a valid call passes, a bad one is refused as on a
    device (the control: the same call with its shapes right)."""
    good = {name: meta_like(t) for name, t in append_args().items()}
    torch.ops.astr.append_kv(**good)
    bad = dict(good, v=torch.empty(3, 1, HEAD_DIM, device="meta"))
    with pytest.raises(RuntimeError, match=r"^v: shape \[3, 1, 8\] does not match v_cache"):
        torch.ops.astr.append_kv(**bad)


def test_append_kv_with_a_v_cache_smaller_than_k_cache_writes_nothing():
    """It used to write k, then fail on v with a reshape error."""
    args = append_args()
    args["v_cache"] = torch.zeros(2, 2, KV_HEADS, HEAD_DIM)  # 2 pages, k_cache has 4
    with pytest.raises(RuntimeError, match=r"^v_cache: shape \[2, 2, 2, 8\] does not match"):
        torch.ops.astr.append_kv(**args)
    assert not args["k_cache"].any() and not args["v_cache"].any()


def test_append_kv_control_a_valid_call_writes_both_pools():
    args = append_args()
    torch.ops.astr.append_kv(**args)
    slots = args["k_cache"].view(8, KV_HEADS, HEAD_DIM)
    assert torch.equal(slots[[5, 0, 3]], args["k"])
    assert torch.equal(args["v_cache"].view(8, KV_HEADS, HEAD_DIM)[[5, 0, 3]], args["v"])


APPEND_BREAKS = {
    "v_cache fewer pages": dict(v_cache=torch.zeros(3, 2, KV_HEADS, HEAD_DIM)),
    "v_cache larger page": dict(v_cache=torch.zeros(4, 4, KV_HEADS, HEAD_DIM)),
    "v_cache other dtype": dict(v_cache=torch.zeros(4, 2, KV_HEADS, HEAD_DIM).double()),
    "v tokens": dict(v=torch.randn(2, KV_HEADS, HEAD_DIM)),
    "v heads": dict(v=torch.randn(3, 1, HEAD_DIM)),
    "slot past the pool": dict(slot_mapping=int32(5, 8, 0)),
    "slot_mapping int64": dict(slot_mapping=torch.tensor([5, 0, 3])),
    "slot_mapping 2-D": dict(slot_mapping=int32(5, 0, 3).view(3, 1)),
    "k_cache transposed": dict(k_cache=torch.zeros(2, 4, KV_HEADS, HEAD_DIM).transpose(0, 1)),
}


@pytest.mark.parametrize("case", list(APPEND_BREAKS))
def test_every_refused_append_kv_leaves_both_pools_unchanged(case):
    args = append_args()
    args.update(APPEND_BREAKS[case])
    before = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    with pytest.raises(RuntimeError):
        torch.ops.astr.append_kv(**args)
    for name, pool in before.items():
        assert torch.equal(args[name], pool), name


def test_compiled_append_kv_traces_through_the_meta_kernel_with_dynamic_token_counts():
    """Fake tensors run the Meta kernel, with symbolic sizes under dynamic shapes."""

    def append_then_sum(k, v, k_cache, v_cache, slots):
        torch.ops.astr.append_kv(k, v, k_cache, v_cache, slots)
        return k_cache.sum() + v_cache.sum()

    compiled = torch.compile(append_then_sum, fullgraph=True, dynamic=True, backend="eager")
    for tokens in (2, 3, 5):
        g = torch.Generator().manual_seed(tokens)
        k, v = randn(tokens, KV_HEADS, HEAD_DIM, g=g), randn(tokens, KV_HEADS, HEAD_DIM, g=g)
        slots = torch.randperm(8, generator=g)[:tokens].to(torch.int32)
        pools = [torch.zeros(4, 2, KV_HEADS, HEAD_DIM) for _ in range(4)]
        compiled(k, v, pools[0], pools[1], slots)
        append_then_sum(k, v, pools[2], pools[3], slots)
        assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
        assert pools[0].any()


def test_compiled_append_kv_refuses_bad_shapes_while_tracing():
    def append(k, v, k_cache, v_cache, slots):
        torch.ops.astr.append_kv(k, v, k_cache, v_cache, slots)
        return k_cache.sum()

    args = append_args()
    args["v_cache"] = torch.zeros(2, 2, KV_HEADS, HEAD_DIM)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="v_cache: shape .* does not match k_cache"):
        torch.compile(append, fullgraph=True, backend="eager")(*args.values())
    assert not args["k_cache"].any()


# -- 5. a failed call changes nothing -------------------------------------------------------


def small_cache(num_pages=4, page_size=4):
    return PagedKVCache(1, num_pages, page_size, KV_HEADS, HEAD_DIM, dtype=torch.float32)


def allocator_state(cache):
    return (
        cache.free_pages,
        {s: (cache.seq_len(s), cache.pages_of(s)) for s in range(4)},
    )


@pytest.mark.parametrize(
    "counts, error",
    [
        ([2, 1.5], "num_new_tokens: expected an integer, got 1.5"),
        ([2, "3"], "num_new_tokens: expected an integer, got '3'"),
        ([2, None], "num_new_tokens: expected an integer, got None"),
        ([2, True], "num_new_tokens: expected an integer, got True"),
    ],
    ids=["float", "str", "None", "bool"],
)
def test_begin_step_with_a_non_integer_count_allocates_nothing(counts, error):
    """It used to raise only after handing the first sequence its pages."""
    cache = small_cache()
    cache.begin_step([0], [3])
    before = allocator_state(cache)
    with pytest.raises(TypeError, match=error):
        cache.begin_step([0, 1], counts)
    assert allocator_state(cache) == before


def test_begin_step_with_a_non_integer_width_allocates_nothing():
    cache = small_cache()
    before = allocator_state(cache)
    with pytest.raises(TypeError, match="block_table_width: expected an integer"):
        cache.begin_step([0, 1], [5, 2], block_table_width=2.5)
    assert allocator_state(cache) == before


def test_begin_step_accepts_integer_like_counts():
    """The control: ints of other types (numpy's, torch's) still count."""
    cache = small_cache()
    step = cache.begin_step([0, 1], [torch.tensor(5), 2])
    assert step.seq_lens.tolist() == [5, 2] and cache.free_pages == 1


def write_step(cache, counts, g, layer=0):
    """Runs one prefill step through the cache; returns the k, v it appended."""
    seq_ids = list(counts)
    cache.begin_step(seq_ids, list(counts.values()))
    tokens = sum(counts.values())
    q = randn(1, tokens, HEADS, HEAD_DIM, g=g)
    k, v = randn(1, tokens, KV_HEADS, HEAD_DIM, g=g), randn(1, tokens, KV_HEADS, HEAD_DIM, g=g)
    attention(q, k, v, kv_cache=cache, layer_id=layer, fwd="prefill", is_causal=True)
    return k[0], v[0]


def stored(cache, seq_id):
    """The k and v the cache holds for a sequence, token by token."""
    k_pool, v_pool = cache.layer(0)
    pages, length, size = cache.pages_of(seq_id), cache.seq_len(seq_id), cache.page_size
    k = torch.stack([k_pool[pages[t // size], t % size] for t in range(length)])
    v = torch.stack([v_pool[pages[t // size], t % size] for t in range(length)])
    return k, v


def test_a_full_cache_ends_the_previous_step_so_no_call_overwrites_its_tokens():
    """After KVCacheFullError, a decode call used to append through the previous step's slot
    mapping, overwriting the token that step had written."""
    g = torch.Generator().manual_seed(5)
    cache = small_cache(num_pages=2)
    k0, v0 = write_step(cache, {0: 4, 1: 4}, g)  # both pages full
    with pytest.raises(KVCacheFullError):
        cache.begin_step([0, 1], [1, 1])
    assert cache.step is None
    q = randn(2, 1, HEADS, HEAD_DIM, g=g)
    kv = randn(2, 1, KV_HEADS, HEAD_DIM, g=g)
    with pytest.raises(RuntimeError, match=r"kv_cache: call begin_step\(\.\.\.\)"):
        attention(q, kv, kv, kv_cache=cache, fwd="decode")
    assert torch.equal(torch.cat([stored(cache, 0)[0], stored(cache, 1)[0]]), k0)
    assert torch.equal(torch.cat([stored(cache, 0)[1], stored(cache, 1)[1]]), v0)


def test_freeing_a_sequence_of_the_step_ends_the_step():
    """The step used to survive free(): a later call appended into the freed page, which the
    next sequence to start would own."""
    g = torch.Generator().manual_seed(6)
    cache = small_cache(num_pages=2)
    write_step(cache, {0: 3, 1: 2}, g)
    cache.free(1)
    assert cache.step is None
    pools = [t.clone() for t in cache.layer(0)]
    with pytest.raises(RuntimeError, match=r"kv_cache: call begin_step"):
        attention(
            randn(1, 5, HEADS, HEAD_DIM, g=g),
            randn(1, 5, KV_HEADS, HEAD_DIM, g=g),
            randn(1, 5, KV_HEADS, HEAD_DIM, g=g),
            kv_cache=cache,
            fwd="prefill",
        )
    assert all(torch.equal(a, b) for a, b in zip(pools, cache.layer(0)))


def test_freeing_a_sequence_outside_the_step_keeps_the_step():
    g = torch.Generator().manual_seed(7)
    cache = small_cache()
    write_step(cache, {0: 3}, g)
    step = cache.begin_step([1], [2])
    cache.free(0)
    assert cache.step is step


def test_a_refused_begin_step_ends_the_previous_step():
    cache = small_cache()
    cache.begin_step([0], [2])
    with pytest.raises(ValueError, match="seq_ids: a sequence appears twice"):
        cache.begin_step([1, 1], [1, 1])
    assert cache.step is None
    assert allocator_state(cache)[0] == 3  # the refused step took no page


def copy_case():
    """A captured decode step of two sequences and a prefill of the same batch whose
    block_table/seq_lens/query_start_loc shapes match the captured ones, slot_mapping not."""
    cache = small_cache(num_pages=8)
    cache.begin_step([0, 1], [2, 2])
    captured = cache.begin_step([0, 1], [1, 1], block_table_width=2)
    other = small_cache(num_pages=8).begin_step([0, 1], [3, 2], block_table_width=2)
    return captured, other


StepFields = ("block_table", "seq_lens", "query_start_loc", "slot_mapping")


def test_step_metadata_copy_checks_every_shape_before_copying():
    """copy_ used to copy block_table, seq_lens and query_start_loc, then refuse slot_mapping."""
    captured, other = copy_case()
    before = {n: getattr(captured, n).clone() for n in StepFields}
    assert not torch.equal(captured.seq_lens, other.seq_lens)  # a copy would show
    with pytest.raises(ValueError, match=r"slot_mapping: shape \(5,\) does not match"):
        captured.copy_(other)
    for name, value in before.items():
        assert torch.equal(getattr(captured, name), value), name


def test_step_metadata_copy_checks_max_query_len_and_mode_before_copying():
    cache = small_cache(num_pages=8)
    captured = cache.begin_step([0, 1], [1, 2], block_table_width=2)  # prefill, T=3
    longer = small_cache(num_pages=8).begin_step([0, 1], [3, 1], block_table_width=2)
    before = {n: getattr(captured, n).clone() for n in StepFields}
    # Same shapes ([2, 2], [2], [3], slot_mapping [4] vs [3]): make them match first.
    longer.slot_mapping = longer.slot_mapping[:3]
    with pytest.raises(ValueError, match="max_query_len: 3 is larger than the captured step's 2"):
        captured.copy_(longer)
    decode = small_cache(num_pages=8).begin_step([0, 1], [1, 1], block_table_width=2)
    decode.slot_mapping = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="mode: a decode step cannot replay a captured prefill"):
        captured.copy_(decode)
    for name, value in before.items():
        assert torch.equal(getattr(captured, name), value), name


def test_step_metadata_copy_control_a_matching_step_is_copied():
    cache = small_cache(num_pages=8)
    captured = cache.begin_step([0, 1], [1, 1], block_table_width=2)
    nxt = cache.begin_step([0, 1], [1, 1], block_table_width=2)
    captured.copy_(nxt)
    assert torch.equal(captured.seq_lens, nxt.seq_lens)
    assert torch.equal(captured.slot_mapping, nxt.slot_mapping)


def test_cache_append_names_k_or_v_when_the_token_counts_do_not_match_the_step():
    """It used to report a slot_mapping error (an argument the caller never passed)."""
    cache = small_cache()
    cache.begin_step([0], [2])
    k_pool = cache.layer(0)[0].clone()
    good = torch.randn(2, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"^k: 3 tokens .* this step \(begin_step\) adds 2"):
        cache.append(0, torch.randn(3, KV_HEADS, HEAD_DIM), good)
    with pytest.raises(ValueError, match=r"^v: 3 tokens .* this step \(begin_step\) adds 2"):
        cache.append(0, good, torch.randn(3, KV_HEADS, HEAD_DIM))
    assert torch.equal(cache.layer(0)[0], k_pool)
    cache.append(0, good, good)  # the control
    assert not torch.equal(cache.layer(0)[0], k_pool)


# -- 6. the override stack: out-of-order exits, asyncio tasks, warnings ---------------------


def test_contexts_exited_out_of_order_each_remove_their_own_entry():
    """Exiting the outer context first used to raise and leave it on the stack for good."""
    outer, inner = attn_backend("cuda"), attn_backend("torch_native")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order: no error
    assert get_backend(use_default=False) is inner.backend
    assert torch.ops.astr.selected_backend() == ("torch_native", 2)
    inner.__exit__(None, None, None)
    assert get_backend(use_default=False) is None
    assert torch.ops.astr.selected_backend() == ("", 4)


def test_exiting_a_context_twice_raises_and_leaves_the_others():
    outer = attn_backend("torch_native")
    with outer:
        context = attn_backend("torch_native")  # the same backend: its exit must not take outer's
        context.__enter__()
        context.__exit__(None, None, None)
        with pytest.raises(RuntimeError, match="is not an open context"):
            context.__exit__(None, None, None)
        assert torch.ops.astr.selected_backend() == ("torch_native", 2)
        assert THREAD_CONTEXTS.entries == outer._entries  # outer's own entry, still open


def test_a_backend_instance_entered_twice_exits_one_entry_at_a_time():
    backend = TorchNativeBackend()
    with backend:
        with backend:
            assert torch.ops.astr.selected_backend() == ("torch_native", 2)
        assert get_backend(use_default=False) is backend
    assert get_backend(use_default=False) is None


def test_a_context_exited_on_another_thread_is_gone_for_its_own_thread_too():
    q, k, v = dense_qkv()
    context = attn_backend("cuda")
    context.__enter__()
    exiter = threading.Thread(target=context.__exit__, args=(None, None, None))
    exiter.start()
    exiter.join()
    assert get_backend(use_default=False) is None
    assert explain(q, k, v).source == "default"
    assert attention(q, k, v).shape == q.shape  # no strict cuda left behind
    # This thread's C++ stack drops the entry at its next enter or exit.
    with attn_backend("torch_native"):
        assert torch.ops.astr.selected_backend() == ("torch_native", 2)
    assert torch.ops.astr.selected_backend() == ("", 4)


def test_a_context_held_by_a_generator_and_exited_from_another_task_is_gone():
    """A generator runs in whichever task advances it: entered in task a, exited in task b."""
    q, k, v = dense_qkv()

    def holder():
        with attn_backend("cuda"):
            yield

    held = holder()
    seen = {}

    async def enters():
        next(held)
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # b exits meanwhile
        seen["a"] = (get_backend(use_default=False), explain(q, k, v).source)

    async def exits():
        await asyncio.sleep(0)
        next(held, None)

    async def main():
        await asyncio.gather(enters(), exits())

    asyncio.run(main())
    assert seen["a"] == (None, "default")


def test_pop_backend_by_id_removes_that_entry_and_refuses_an_unknown_id():
    first = torch.ops.astr.push_backend("cuda")
    second = torch.ops.astr.push_backend("torch_native")
    torch.ops.astr.pop_backend(first)
    assert torch.ops.astr.selected_backend() == ("torch_native", 2)
    with pytest.raises(RuntimeError, match=f"pop_backend: no override with id {first}"):
        torch.ops.astr.pop_backend(first)
    torch.ops.astr.pop_backend(second)


def test_asyncio_tasks_sharing_a_thread_see_only_their_own_contexts():
    """Task a enters a strict cuda context and awaits; task b, on the same thread, used to run
    its calls under it. Each task also exits while the other's context is above its own."""
    q, k, v = dense_qkv()
    seen = {}

    async def task_a(a_entered, b_entered):
        with attn_backend("cuda"):
            a_entered.set()
            await b_entered.wait()
            seen["a"] = (get_backend(use_default=False).name, explain(q, k, v).requested)
        # Exits below b's context on the thread's stack.
        seen["a after"] = get_backend(use_default=False)

    async def task_b(a_entered, b_entered):
        await a_entered.wait()
        seen["b outside"] = (get_backend(use_default=False), explain(q, k, v).source)
        seen["b runs"] = attention(q, k, v).shape  # under a's cuda context it would raise
        with attn_backend("torch_native"):
            b_entered.set()
            await asyncio.sleep(0)
            await asyncio.sleep(0)  # a exits meanwhile
            seen["a exited first"] = "a after" in seen
            seen["b"] = (get_backend(use_default=False).name, explain(q, k, v).requested)
            seen["b inside runs"] = attention(q, k, v).shape

    async def main():
        a_entered, b_entered = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task_a(a_entered, b_entered), task_b(a_entered, b_entered))

    asyncio.run(main())
    assert seen["a"] == ("cuda", "cuda")
    assert seen["a after"] is None
    assert seen["a exited first"]
    assert seen["b outside"] == (None, "default")
    assert seen["b runs"] == q.shape
    assert seen["b"] == ("torch_native", "torch_native")
    assert seen["b inside runs"] == q.shape


def test_a_task_inherits_the_contexts_open_where_it_was_created():
    q, k, v = dense_qkv()

    async def child():
        await asyncio.sleep(0)
        return explain(q, k, v).requested

    async def main():
        with attn_backend("torch_native"):
            task = asyncio.create_task(child())
        return await task  # runs after the parent has exited its context

    assert asyncio.run(main()) == "torch_native"


def test_unknown_environment_backend_warns_through_python_warnings(monkeypatch):
    """The warning used to bypass Python's warnings module (printed by c10 to stderr)."""
    value = f"no-such-backend-{uuid.uuid4().hex[:8]}"  # warned once per process per value
    monkeypatch.setenv("ASTR_BACKEND", value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.ops.astr.selected_backend() == ("", 4)
        torch.ops.astr.selected_backend()
    mine = [w for w in caught if value in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "valid: cuda, flash, torch_native" in str(mine[0].message)
    assert issubclass(mine[0].category, UserWarning)  # astrai's own: AstraiWarning


def test_environment_warnings_turned_into_errors_raise(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", f"no-such-backend-{uuid.uuid4().hex[:8]}")
    q, k, v = dense_qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="AstraiWarning .* is not a backend"):
            attention(q, k, v)


@pytest.mark.skipif(CudaBackend.available(), reason="the cuda backend can run here")
def test_an_environment_fallback_warns_through_python_warnings():
    """ASTR_BACKEND=cuda where cuda cannot run: the fallback is reported once per process, so a
    fresh one is asked."""
    result = run_python(
        """
        import os, warnings, torch
        os.environ["ASTR_BACKEND"] = "cuda"
        from astrai.extension import attention
        q = torch.randn(1, 3, 2, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            attention(q, q, q)
        print([str(w.message) for w in caught])
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "using torch_native (requested: cuda, environment); skipped cuda" in result.stdout


@pytest.mark.parametrize(
    "name, backend_cls", [("cuda", CudaBackend), ("flash", FlashAttnBackend)], ids=str
)
def test_get_backend_skips_an_environment_backend_that_cannot_run_here(
    monkeypatch, name, backend_cls
):
    if backend_cls.available():
        pytest.skip(f"{name} can run here")
    monkeypatch.setenv("ASTR_BACKEND", name)
    assert get_backend(use_default=False) is None
    assert get_backend().available()
    # The default's choice: the first available backend (which a call it can run runs on).
    assert get_backend() is _priority_backends()[0]


def test_get_backend_control_a_runnable_environment_backend_is_reported(monkeypatch):
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    assert isinstance(get_backend(use_default=False), TorchNativeBackend)


# -- 7. unclear or missing errors -----------------------------------------------------------


def paged_args(batch=1, tokens=3, width=2, mode="prefill"):
    g = torch.Generator().manual_seed(8)
    return dict(
        q=randn(tokens, HEADS, HEAD_DIM, g=g),
        k_cache=randn(4, 4, KV_HEADS, HEAD_DIM, g=g),
        v_cache=randn(4, 4, KV_HEADS, HEAD_DIM, g=g),
        block_table=torch.zeros(batch, width, dtype=torch.int32),
        seq_lens=torch.full((batch,), 3, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + [tokens] * batch, dtype=torch.int32),
        max_query_len=tokens,
        mode=mode,
    )


def on_meta(args):
    return {n: meta_like(t) if isinstance(t, torch.Tensor) else t for n, t in args.items()}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_an_empty_batch_with_query_tokens_names_q(mode, device):
    """It used to raise IndexError (CPU) or a reshape error (other devices)."""
    args = paged_args(batch=0, mode=mode)
    args = on_meta(args) if device == "meta" else args
    with pytest.raises(RuntimeError, match="^q: 3 query tokens, but the batch has no sequences"):
        torch.ops.astr.attention(**args)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_an_empty_batch_without_query_tokens_has_an_empty_answer(mode):
    """The valid neighbour of the case above (it failed on a reshape in torch_native)."""
    args = paged_args(batch=0, tokens=0, mode=mode)
    args["max_query_len"] = 1
    args["q"].requires_grad_()
    out = torch.ops.astr.attention(**args)
    assert out.shape == (0, HEADS, HEAD_DIM)
    out.sum().backward()  # a training step over an empty batch still runs
    assert out_of_meta(args).shape == (0, HEADS, HEAD_DIM)


def out_of_meta(args):
    return torch.ops.astr.attention(**on_meta({**args, "q": args["q"].detach()}))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_block_table_without_columns_names_block_table(device):
    """It used to fail on a reshape."""
    args = paged_args(width=0)
    args = on_meta(args) if device == "meta" else args
    with pytest.raises(RuntimeError, match=r"^block_table: expected at least one page column"):
        torch.ops.astr.attention(**args)


ZERO_D_CALLS = {
    "op dense": lambda q: torch.ops.astr.attention(q, q, q),
    "op paged": lambda q: torch.ops.astr.attention(**dict(paged_args(), q=q)),
    "api dense": lambda q: attention(q, q, q),
    "api paged": lambda q: attention(q, None, None, kv_cache=decoding_cache(), fwd="decode"),
    "explain paged": lambda q: explain(q, kv_cache=decoding_cache(), fwd="decode"),
    "supports_call": lambda q: TorchNativeBackend().supports_call(q, None, None, False, None),
}


def decoding_cache():
    cache = small_cache()
    cache.begin_step([0], [1])
    return cache


@pytest.mark.parametrize("entry", list(ZERO_D_CALLS))
def test_a_zero_dim_q_names_q(entry):
    """Some entries used to raise IndexError."""
    with pytest.raises(RuntimeError, match="^q: expected"):
        ZERO_D_CALLS[entry](torch.tensor(1.0))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_scale_is_refused(scale):
    """It used to return NaN or zeros silently."""
    q, k, v = dense_qkv()
    with pytest.raises(ValueError, match=r"^scale: expected a finite number, got (nan|inf|-inf)"):
        attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=r"^scale: expected a finite number"):
        torch.ops.astr.attention(**paged_args(), scale=scale)
    with pytest.raises(ValueError, match=r"^scale: expected a finite number"):
        explain(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [0.0, -0.5, 1e-30, 3.0])
def test_a_finite_scale_is_used_as_given(scale):
    q, k, v = dense_qkv()
    out = attention(q, k, v, scale=scale)
    assert_close_to_reference(out, dense_reference(q, k, v, is_causal=False, scale=scale))


def test_a_huge_max_query_len_runs_as_its_bound():
    """The op sized a buffer by it and failed inside the allocator; it is an upper bound on any
    sequence's new tokens, as the call's token count is."""
    cache = small_cache(num_pages=8)
    g = torch.Generator().manual_seed(9)
    write_step(cache, {0: 5, 1: 2}, g)
    step = cache.begin_step([0, 1], [3, 4])
    cache.append(0, randn(7, KV_HEADS, HEAD_DIM, g=g), randn(7, KV_HEADS, HEAD_DIM, g=g))
    q = randn(7, HEADS, HEAD_DIM, g=g)
    k_pool, v_pool = cache.layer(0)
    call = dict(
        q=q,
        k_cache=k_pool,
        v_cache=v_pool,
        block_table=step.block_table,
        seq_lens=step.seq_lens,
        query_start_loc=step.query_start_loc,
        mode="prefill",
        is_causal=True,
    )
    huge = torch.ops.astr.attention(**call, max_query_len=10**15)
    ref = paged_reference(
        q, k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc, is_causal=True
    )
    assert_close_to_reference(huge, ref)
    with pytest.raises(RuntimeError, match="max_query_len: 3 is less than sequence 1's 4"):
        torch.ops.astr.attention(**call, max_query_len=3)  # the control: a bound too small


# -- 2. one sequence's values never reach another's output (torch_native's gather) ----------


@pytest.mark.parametrize("poison", ["inf in k", "nan in v"])
def test_a_non_finite_value_in_one_sequence_never_reaches_another(poison):
    """Sequence 0 (10 tokens) owns page 0; sequence 1 (2 tokens) has one page, and the padded
    columns of its block-table row point at page 0."""
    g = torch.Generator().manual_seed(10)
    cache = PagedKVCache(1, 8, 4, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    step = cache.begin_step([0, 1], [10, 2])
    k, v = randn(12, KV_HEADS, HEAD_DIM, g=g), randn(12, KV_HEADS, HEAD_DIM, g=g)
    if poison == "inf in k":
        k[3] = float("inf")
    else:
        v[3] = float("nan")
    cache.append(0, k, v)
    q = randn(12, HEADS, HEAD_DIM, g=g)
    k_pool, v_pool = cache.layer(0)
    out = attention(q[None], None, None, kv_cache=cache, fwd="prefill", is_causal=True)[0]
    ref = paged_reference(
        q, k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc, is_causal=True
    )
    assert_close_to_reference(out[10:], ref[10:])  # sequence 1 never reads page 0


def test_a_freed_page_holding_nan_gives_its_next_owner_nothing_of_it():
    g = torch.Generator().manual_seed(11)
    cache = small_cache(num_pages=2)
    cache.begin_step([0], [4])
    k, v = randn(4, KV_HEADS, HEAD_DIM, g=g), randn(4, KV_HEADS, HEAD_DIM, g=g)
    v[3] = float("nan")
    cache.append(0, k, v)
    page = cache.pages_of(0)[0]
    cache.free(0)
    step = cache.begin_step([1], [2])
    assert cache.pages_of(1) == [page]  # slots 2 and 3 still hold sequence 0's tokens
    cache.append(0, randn(2, KV_HEADS, HEAD_DIM, g=g), randn(2, KV_HEADS, HEAD_DIM, g=g))
    q = randn(2, HEADS, HEAD_DIM, g=g)
    out = attention(q[None], None, None, kv_cache=cache, fwd="prefill", is_causal=True)[0]
    k_pool, v_pool = cache.layer(0)
    ref = paged_reference(
        q, k_pool, v_pool, step.block_table, step.seq_lens, step.query_start_loc, is_causal=True
    )
    assert_close_to_reference(out, ref)
