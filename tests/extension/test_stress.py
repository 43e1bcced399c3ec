"""Stress: many threads and asyncio tasks entering nested ``attn_backend`` contexts, some raising
midway, each checking at every level that its calls see its own innermost choice and that
nothing is left behind; and a KV cache run out of pages again and again, recovering by freeing
sequences, with nothing stored ever lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import pytest
import torch

from astrai.extension import (
    AttentionBackend,
    KVCacheFullError,
    PagedKVCache,
    attention,
    attn_backend,
    explain,
    get_backend,
)
from astrai.extension.selection import THREAD_CONTEXTS
from tests.reference import assert_close_to_reference, attend, gather_tokens

BUILTIN_NAMES = ("cuda", "flash", "torch_native")


class Boom(Exception):
    pass


class Marked(AttentionBackend):
    """A backend written in Python whose output says it ran: every value is ``mark``."""

    def __init__(self, mark: float):
        self.mark = mark

    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        return torch.full_like(q, self.mark)


@pytest.fixture(autouse=True)
def no_environment_backend(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    yield
    assert torch.ops.astr.selected_backend() == ("", 4)
    assert THREAD_CONTEXTS.entries == []


def dense_qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 3, 2, 8, generator=g) for _ in range(3))


Q, K, V = dense_qkv()


def check_innermost(choice, runs_calls=True):
    """What the calling thread or task sees inside its innermost context ``choice`` (a builtin
    name or a Marked backend)."""
    backend = get_backend(use_default=False)
    if isinstance(choice, Marked):
        assert backend is choice
        if runs_calls:
            assert torch.equal(attention(Q, K, V), torch.full_like(Q, choice.mark))
        return
    assert backend.name == choice
    decision = explain(Q, K, V)
    assert (decision.source, decision.requested) == ("context", choice)
    if not runs_calls:
        return
    if decision.backend == choice:
        assert attention(Q, K, V).shape == Q.shape
    else:  # a strict choice that cannot run the call raises, and changes nothing
        with pytest.raises(RuntimeError, match=f"Explicitly-set backend '{choice}'"):
            attention(Q, K, V)


def random_plan(rng):
    depth = rng.randint(1, 4)
    choices = [
        Marked(rng.random()) if rng.random() < 0.2 else rng.choice(BUILTIN_NAMES)
        for _ in range(depth)
    ]
    return choices, rng.randint(0, depth)  # raise at that level; depth: run to the end


def run_plan_in_thread(rng, iterations):
    for _ in range(iterations):
        choices, raise_at = random_plan(rng)
        with contextlib.suppress(Boom), contextlib.ExitStack() as stack:
            for level, choice in enumerate(choices):
                stack.enter_context(attn_backend(choice))
                check_innermost(choice, runs_calls=rng.random() < 0.5)
                assert torch.ops.astr.selected_backend() == (
                    choice if isinstance(choice, str) else f"python:{type(choice).__qualname__}",
                    2,  # a context
                )
                if level == raise_at:
                    raise Boom
        assert get_backend(use_default=False) is None
        assert torch.ops.astr.selected_backend() == ("", 4)


def run_threads(target, count):
    errors = []

    def guarded(seed):
        try:
            target(seed)
        except BaseException as error:  # noqa: B036  (reported by the main thread)
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


def test_threads_with_nested_overrides_and_exceptions_see_only_their_own():
    run_threads(lambda seed: run_plan_in_thread(random.Random(seed), 25), count=12)


async def run_plan_in_task(rng, iterations):
    """As run_plan_in_thread, with an await between every step, so that the tasks of one loop
    interleave their enters, checks and exits."""
    for _ in range(iterations):
        choices, raise_at = random_plan(rng)
        try:
            with contextlib.ExitStack() as stack:
                for level, choice in enumerate(choices):
                    stack.enter_context(attn_backend(choice))
                    await asyncio.sleep(0)
                    check_innermost(choice, runs_calls=rng.random() < 0.5)
                    await asyncio.sleep(0)
                    if level == raise_at:
                        raise Boom
        except Boom:
            pass
        assert get_backend(use_default=False) is None
        await asyncio.sleep(0)


async def run_tasks(seed, count, iterations):
    await asyncio.gather(
        *(run_plan_in_task(random.Random(seed * 1000 + t), iterations) for t in range(count))
    )


def test_asyncio_tasks_with_nested_overrides_and_exceptions_see_only_their_own():
    asyncio.run(run_tasks(0, count=24, iterations=10))
    assert torch.ops.astr.selected_backend() == ("", 4)


def test_event_loops_on_several_threads_at_once():
    run_threads(lambda seed: asyncio.run(run_tasks(seed + 1, count=6, iterations=6)), count=4)


# -- page exhaustion and recovery -------------------------------------------------------------


class ServingRun:
    """A cache of a few pages serving sequences that arrive, grow and finish, through the Python
    API on torch_native. Every k/v row written is recorded, per layer and sequence, so that the
    pools can be checked against the record and each output against the definition."""

    def __init__(self, seed, num_pages=10, page_size=4, layers=2):
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = 4, 2, 8
        self.cache = PagedKVCache(
            layers, num_pages, page_size, self.kv_heads, self.head_dim, dtype=torch.float32
        )
        self.written = {}  # seq_id -> [per layer: list of (k [Hkv, D], v [Hkv, D])]
        self.next_id = 0
        self.refusals = 0

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def plan(self):
        """Some live sequences decode or extend, and sometimes a new one arrives."""
        live = list(self.written)
        chosen = self.rng.sample(live, self.rng.randint(0, len(live))) if live else []
        counts = {s: self.rng.choice([1, 1, 1, 2, 5]) for s in chosen}
        if not counts or self.rng.random() < 0.4:
            counts[self.next_id] = self.rng.randint(1, 9)
        return counts

    def step(self):
        counts = self.plan()
        try:
            self.cache.begin_step(list(counts), list(counts.values()))
        except KVCacheFullError:
            self.refusals += 1
            self.check_stored()  # the refusal lost nothing
            assert self.cache.step is None
            victim = self.rng.choice(list(self.written))  # a sequence finishes early
            self.cache.free(victim)
            del self.written[victim]
            self.check_stored()
            return
        if self.next_id in counts:
            self.written[self.next_id] = [[] for _ in range(self.cache.num_layers)]
            self.next_id += 1
        mode = "decode" if all(n == 1 for n in counts.values()) else "prefill"
        tokens = sum(counts.values())
        for layer in range(self.cache.num_layers):
            q = self.randn(tokens, self.heads, self.head_dim)
            k = self.randn(tokens, self.kv_heads, self.head_dim)
            v = self.randn(tokens, self.kv_heads, self.head_dim)
            shape = (tokens, 1) if mode == "decode" else (1, tokens)
            out = attention(
                q.view(*shape, self.heads, self.head_dim),
                k.view(*shape, self.kv_heads, self.head_dim),
                v.view(*shape, self.kv_heads, self.head_dim),
                kv_cache=self.cache,
                layer_id=layer,
                fwd=mode,
                is_causal=True,
            ).reshape(tokens, self.heads, self.head_dim)
            start = 0
            for seq_id, n in counts.items():
                rows = self.written[seq_id][layer]
                rows.extend(zip(k[start : start + n], v[start : start + n]))
                keys = torch.stack([r[0] for r in rows])
                values = torch.stack([r[1] for r in rows])
                length = len(rows)
                visible = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
                ref = attend(q[start : start + n], keys, values, visible, self.head_dim**-0.5)
                assert_close_to_reference(out[start : start + n], ref)
                start += n

    def check_stored(self):
        for seq_id, layers in self.written.items():
            pages = self.cache.pages_of(seq_id)
            assert self.cache.seq_len(seq_id) == len(layers[0])
            for layer, rows in enumerate(layers):
                k_pool, v_pool = self.cache.layer(layer)
                keys = torch.stack([k for k, _ in rows])
                values = torch.stack([v for _, v in rows])
                assert torch.equal(gather_tokens(k_pool, pages, len(rows)), keys), (seq_id, layer)
                assert torch.equal(gather_tokens(v_pool, pages, len(rows)), values), (seq_id, layer)
        owned = [p for s in self.written for p in self.cache.pages_of(s)]
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert len(owned) + self.cache.free_pages == self.cache.num_pages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_page_exhaustion_with_recovery_loses_nothing_stored(seed):
    run = ServingRun(seed)
    for _ in range(60):
        run.step()
    run.check_stored()
    assert run.refusals >= 3  # the pool did run out, and the run went on
