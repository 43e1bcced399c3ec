"""``attn_backend`` contexts shared between threads and asyncio tasks (issue 47, item 5), and a
context that a finished thread left open (item 13).

One context object (or one backend object, ``with backend:``) may be entered by several threads
or tasks at once: each exit removes the exiting thread's or task's own entry, so that neither
keeps its choice after its block nor loses it inside. Every step is ordered by barriers and
events, so each test takes one path.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from astrai import AttentionBackend, attention, attn_backend, explain, get_backend
from astrai.extension import selection
from astrai.extension.selection import BackendSource, thread_selection

Q, K, V = (torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))


class Doubling(AttentionBackend):
    """A backend written in Python whose output shows that it ran: 2 q."""

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        return 2 * q


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    yield
    assert thread_selection() == (None, BackendSource.DEFAULT)
    assert selection.THREAD_CONTEXTS.entries == []
    assert get_backend(use_default=False) is None


# The shared object, entered as ``with shared:``, and the backend the calls inside should see.
SHARED = {
    "attn_backend-object": lambda: (attn_backend("torch_native"), "torch_native"),
    "backend-object": lambda: (Doubling(),) * 2,
}


def seen(expected):
    """What the calling thread or task sees, in the terms of ``expected`` (a name or a backend
    object): through the Python API, and on its C++ stack when ``on_thread``."""
    backend = get_backend(use_default=False)
    if backend is None:
        return None
    if isinstance(expected, str):
        assert explain(Q, K, V).requested == expected
        return backend.name
    assert torch.equal(attention(Q, K, V), 2 * Q)
    return backend


def native_name(expected):
    return expected if isinstance(expected, str) else f"python:{type(expected).__qualname__}"


@pytest.mark.parametrize("shared_kind", list(SHARED))
def test_one_context_entered_by_two_threads_each_exit_removes_its_own(shared_kind):
    shared, expected = SHARED[shared_kind]()
    first_entered = threading.Event()
    both_inside = threading.Barrier(2, timeout=30)
    first_exited = threading.Event()
    second_looked = threading.Event()
    results = {}

    def first():
        with shared:
            first_entered.set()
            both_inside.wait()
        first_exited.set()
        results["first after its block"] = (seen(expected), thread_selection())
        second_looked.wait(30)

    def second():
        first_entered.wait(30)  # entered second: its entry is the object's last
        with shared:
            both_inside.wait()
            first_exited.wait(30)
            results["second inside, after first exited"] = (seen(expected), thread_selection())
            second_looked.set()
        results["second after its block"] = (seen(expected), thread_selection())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    no_context = (None, (None, BackendSource.DEFAULT))
    assert results == {
        "first after its block": no_context,
        "second inside, after first exited": (
            expected,
            (native_name(expected), BackendSource.CONTEXT),
        ),
        "second after its block": no_context,
    }


@pytest.mark.parametrize("shared_kind", list(SHARED))
def test_one_context_entered_by_two_tasks_each_exit_removes_its_own(shared_kind):
    shared, expected = SHARED[shared_kind]()
    results = {}

    async def first(second_entered, first_exited):
        with shared:
            await second_entered.wait()
        first_exited.set()
        results["first after its block"] = seen(expected)

    async def second(second_entered, first_exited):
        await asyncio.sleep(0)  # the first task enters first
        with shared:
            second_entered.set()
            await first_exited.wait()
            results["second inside, after first exited"] = seen(expected)
        results["second after its block"] = seen(expected)

    async def main():
        second_entered, first_exited = asyncio.Event(), asyncio.Event()
        await asyncio.gather(
            first(second_entered, first_exited), second(second_entered, first_exited)
        )

    asyncio.run(main())
    assert results == {
        "first after its block": None,
        "second inside, after first exited": expected,
        "second after its block": None,
    }


def test_the_second_task_exiting_first_leaves_the_first_its_context():
    """The same, exited in the other order: each exit still finds its own entry."""
    shared = attn_backend("torch_native")
    results = {}

    async def first(second_exited):
        with shared:
            await asyncio.sleep(0)  # the second task enters and exits
            await second_exited.wait()
            results["first inside"] = seen("torch_native")
        results["first after"] = seen("torch_native")

    async def second(second_exited):
        with shared:
            await asyncio.sleep(0)
        second_exited.set()
        results["second after"] = seen("torch_native")

    async def main():
        second_exited = asyncio.Event()
        await asyncio.gather(first(second_exited), second(second_exited))

    asyncio.run(main())
    assert results == {"first inside": "torch_native", "first after": None, "second after": None}


# -- a context that a finished thread left open ----------------------------------------------


def leave_a_context_open_on_a_thread(context):
    def enter_and_end():
        context.__enter__()  # never exited: the thread ends with it open

    thread = threading.Thread(target=enter_and_end)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()


class ThreadStateRead(AssertionError):
    pass


class Untouchable(threading.local):
    """Stands in for the per-thread contexts: reading them fails the test."""

    @property
    def entries(self):
        raise ThreadStateRead("an eager call outside any context read the thread's contexts")


def test_a_context_left_open_by_a_finished_thread_changes_nothing_later():
    """It used to keep a process-wide count of open entries above zero for good, sending every
    later call of every thread down the path that reads its thread's contexts."""
    context = attn_backend("cuda")  # strict, and unable to run these CPU calls
    leave_a_context_open_on_a_thread(context)
    assert get_backend(use_default=False) is None
    assert explain(Q, K, V).source == "default"
    assert attention(Q, K, V).shape == Q.shape
    # The cost path: an eager call outside any context reads no thread state, as before.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selection, "THREAD_CONTEXTS", Untouchable())
        assert get_backend(use_default=False) is None
        assert explain(Q, K, V).source == "default"
        out = attention(Q, K, V)
    torch.testing.assert_close(out, attention(Q, K, V, backend="torch_native"))
    # Its object can still be exited, from here: that entry is withdrawn.
    context.__exit__(None, None, None)
    with pytest.raises(RuntimeError, match="is not an open context"):
        context.__exit__(None, None, None)


def test_control_the_stand_in_fails_what_reads_the_thread_contexts():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selection, "THREAD_CONTEXTS", Untouchable())
        with pytest.raises(ThreadStateRead):
            attn_backend("torch_native").__enter__()
