"""A property of the Python API over random serving runs (issue 47): steps of a PagedKVCache
(``begin_step``, then ``attention`` on every layer) with random variants (window, softcap,
sinks, masks, scale, ``return_lse``), backend choices (none, ``backend=``, a context), FP8
pools, and refused calls in between:

- a refused call changes nothing: pools, scales, the step and the allocator stay bit-exact, and
  the context stacks are as before;
- every accepted call equals attention written from its definition in float64, over the keys
  the test itself recorded (quantized through the scales for an FP8 cache), and the pools hold
  exactly what was written.
"""

from __future__ import annotations

import math

import pytest
import torch

from astrai import KVCacheFullError, PagedKVCache, attention, attn_backend
from astrai.extension.selection import (
    TASK_CONTEXTS,
    THREAD_CONTEXTS,
    BackendSource,
    thread_selection,
)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

RUNS = settings(max_examples=200, deadline=None, derandomize=True)
FP8 = torch.float8_e4m3fn


# -- the definition --------------------------------------------------------------------------


def reference(q, keys, values, positions, call):
    """One sequence's (out [n, Hq, D], lse [n, Hq]) in float64: s = scale * q.k, softcapped to
    c * tanh(s / c); the query at position p sees the keys j <= p (causal), j >= p - W (window)
    and j with mask True; softmax over the seen keys plus one sink logit per head (no value)."""
    q, keys, values = q.double(), keys.double(), values.double()
    n, q_heads, head_dim = q.shape
    group = q_heads // keys.shape[1]
    scale = call["scale"] if call["scale"] is not None else 1 / math.sqrt(head_dim)
    j = torch.arange(keys.shape[0])[None, :]
    p = positions[:, None]
    seen = torch.ones(n, keys.shape[0], dtype=torch.bool)
    if call["is_causal"]:
        seen &= j <= p
    if call["window_left"] >= 0:
        seen &= j >= p - call["window_left"]
    if call["mask"] is not None:
        seen &= call["mask"]
    out = torch.zeros(n, q_heads, values.shape[-1], dtype=torch.float64)
    lse = torch.empty(n, q_heads, dtype=torch.float64)
    for h in range(q_heads):
        s = scale * q[:, h] @ keys[:, h // group].T
        if call["softcap"] is not None:
            s = call["softcap"] * torch.tanh(s / call["softcap"])
        s = s.masked_fill(~seen, -math.inf)
        logits = s
        if call["sinks"] is not None:
            sink = call["sinks"][h].double().expand(n, 1)
            logits = torch.cat([s, sink], dim=-1)
        lse[:, h] = torch.logsumexp(logits, dim=-1)
        weights = (s - lse[:, h, None]).exp().nan_to_num(0.0)  # a row that sees nothing: 0
        out[:, h] = weights @ values[:, h // group]
    return out, lse


def stored(x, scale):
    """What an FP8 pool gives back for x: fp8(clamp(x / scale)) * scale, per kv head."""
    largest = torch.finfo(FP8).max
    scale = scale[:, None]
    quantized = (x.float() / scale).clamp(-largest, largest).to(FP8)  # (in float32, as written)
    return quantized.double() * scale.double()


# -- the run ---------------------------------------------------------------------------------


def snapshot(cache):
    step = cache.step
    return dict(
        pools=[t.clone().view(torch.uint8) for t in cache.k_pools + cache.v_pools],
        scales=[t.clone() for t in cache.k_scales + cache.v_scales],
        step=(step, cache._step_seq_ids),
        step_tensors=None
        if step is None
        else [
            t.clone()
            for t in (step.block_table, step.seq_lens, step.query_start_loc, step.slot_mapping)
        ],
        allocator=(
            list(cache._free_pages),
            {s: list(p) for s, p in cache._pages.items()},
            dict(cache._lengths),
        ),
    )


def assert_same(before, after):
    for a, b in zip(before["pools"] + before["scales"], after["pools"] + after["scales"]):
        assert torch.equal(a, b)
    assert before["step"][0] is after["step"][0] and before["step"][1] == after["step"][1]
    for a, b in zip(before["step_tensors"] or [], after["step_tensors"] or []):
        assert torch.equal(a, b)
    assert before["allocator"] == after["allocator"]


def contexts():
    return list(THREAD_CONTEXTS.entries), TASK_CONTEXTS.get(), thread_selection()


NO_CONTEXTS = ([], (), (None, BackendSource.DEFAULT))


class Run:
    """A cache and the record of every k/v row written to it (per layer and sequence)."""

    def __init__(self, data):
        self.data = data
        self.g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        self.fp8 = data.draw(st.integers(0, 3)) == 0  # one run in four
        self.kv_heads = data.draw(st.integers(1, 2))
        self.q_heads = self.kv_heads * data.draw(st.integers(1, 2))
        self.head_dim = 4
        self.layers = data.draw(st.integers(1, 2))
        self.dtype = torch.bfloat16 if self.fp8 else torch.float32
        self.cache = PagedKVCache(
            self.layers,
            data.draw(st.integers(2, 6)),
            data.draw(st.sampled_from([1, 2, 4])),
            self.kv_heads,
            self.head_dim,
            dtype=FP8 if self.fp8 else torch.float32,
        )
        if self.fp8:
            for layer in range(self.layers):
                k_scale, v_scale = (
                    torch.rand(self.kv_heads, generator=self.g) / 50 + 0.01 for _ in "kv"
                )
                self.cache.set_scales(layer, k_scale, v_scale)
        self.rows = {}  # seq_id -> per layer: list of (k [Hkv, D], v [Hkv, D]) as written
        self.next_id = 0

    def randn(self, *shape, dtype=None):
        return torch.randn(*shape, generator=self.g).to(dtype or self.dtype)

    def begin_step(self):
        draw = self.data.draw
        live = sorted(self.rows)
        chosen = draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        if not chosen or draw(st.booleans()):
            chosen.append(self.next_id)
        counts = [draw(st.integers(1, 3)) for _ in chosen]
        before = snapshot(self.cache)
        try:
            self.cache.begin_step(chosen, counts)
        except KVCacheFullError:  # refused: it only ends the previous step
            event("refused: begin_step (out of pages)")
            after = snapshot(self.cache)
            assert after["step"] == (None, frozenset())
            assert_same(dict(before, step=(None, frozenset()), step_tensors=None), after)
            if live:
                victim = draw(st.sampled_from(live))
                self.cache.free(victim)
                del self.rows[victim]
            return False
        if self.next_id in chosen:
            self.rows[self.next_id] = [[] for _ in range(self.layers)]
            self.next_id += 1
        self.step = list(zip(chosen, counts))
        return True

    def valid_call(self, layer):
        """A random valid call on ``layer``: (q, k, v, keyword arguments, variants)."""
        draw = self.data.draw
        tokens = sum(n for _, n in self.step)
        decode = all(n == 1 for _, n in self.step)
        is_causal = draw(st.booleans()) or decode
        call = dict(
            is_causal=is_causal,
            window_left=draw(st.sampled_from([-1, 0, 2])) if is_causal else -1,
            softcap=draw(st.sampled_from([None, 0.5, 5.0])),
            sinks=self.randn(self.q_heads, dtype=torch.float32) if draw(st.booleans()) else None,
            scale=draw(st.sampled_from([None, 0.3])),
            return_lse=draw(st.booleans()),
            mask=None,
        )
        longest = max(self.cache.seq_len(s) for s, _ in self.step)
        if draw(st.integers(0, 3)) == 0:  # a bool mask over the kv positions (beyond it: masked)
            width = draw(st.integers(1, longest))
            call["mask"] = torch.rand(tokens, width, generator=self.g) < 0.7
        fwd = "decode" if decode and draw(st.booleans()) else "prefill"
        q, k, v = (
            self.randn(1, tokens, h, self.head_dim)
            for h in (self.q_heads, self.kv_heads, self.kv_heads)
        )
        kwargs = dict(
            kv_cache=self.cache,
            layer_id=layer,
            fwd=fwd,
            is_causal=call["is_causal"],
            window_left=call["window_left"],
            softcap=call["softcap"],
            sinks=call["sinks"],
            scale=call["scale"],
            return_lse=call["return_lse"],
            attn_mask=call["mask"],
        )
        return q, k, v, kwargs, call

    def accepted(self, layer):
        q, k, v, kwargs, call = self.valid_call(layer)
        how = self.data.draw(st.sampled_from(["default", "argument", "context"]))
        if how == "argument":
            kwargs["backend"] = "torch_native"
        if how == "context":
            with attn_backend("torch_native"):
                result = attention(q, k, v, **kwargs)
        else:
            result = attention(q, k, v, **kwargs)
        assert contexts() == NO_CONTEXTS
        out, lse = result if call["return_lse"] else (result, None)
        event("accepted: FP8 cache" if self.fp8 else "accepted: float32 cache")
        for variant in ("sinks", "softcap", "mask"):
            if call[variant] is not None:
                event(f"accepted: {variant}")
        if call["window_left"] >= 0:
            event("accepted: window")
        self.record(layer, k[0], v[0])
        self.check(layer, q[0], out[0], None if lse is None else lse[0], call)

    def record(self, layer, k, v):
        start = 0
        for seq_id, n in self.step:
            self.rows[seq_id][layer].extend(zip(k[start : start + n], v[start : start + n]))
            start += n

    def check(self, layer, q, out, lse, call):
        """The pools hold what was written; the output is the definition's."""
        k_pool, v_pool = self.cache.layer(layer)
        k_scale, v_scale = self.cache.scales(layer)
        start = 0
        for seq_id, n in self.step:
            rows = self.rows[seq_id][layer]
            keys = torch.stack([k for k, _ in rows])
            values = torch.stack([v for _, v in rows])
            length = len(rows)
            pages = self.cache.pages_of(seq_id)
            slots = [
                pages[t // k_pool.shape[1]] * k_pool.shape[1] + t % k_pool.shape[1]
                for t in range(length)
            ]
            in_pool = (
                k_pool.view(-1, *k_pool.shape[2:])[slots],
                v_pool.view(-1, *v_pool.shape[2:])[slots],
            )
            if self.fp8:
                keys, values = stored(keys, k_scale), stored(values, v_scale)
                assert torch.equal(in_pool[0].double() * k_scale.double()[:, None], keys)
                assert torch.equal(in_pool[1].double() * v_scale.double()[:, None], values)
            else:
                assert torch.equal(in_pool[0], keys) and torch.equal(in_pool[1], values)
            row_call = dict(call)
            if call["mask"] is not None:
                mask = call["mask"][start : start + n]
                row_call["mask"] = torch.zeros(n, length, dtype=torch.bool)
                width = min(mask.shape[1], length)
                row_call["mask"][:, :width] = mask[:, :width]
            positions = torch.arange(length - n, length)
            want_out, want_lse = reference(q[start : start + n], keys, values, positions, row_call)
            tolerance = 3e-2 if self.fp8 else 2e-5
            torch.testing.assert_close(
                out[start : start + n].double(), want_out, atol=tolerance, rtol=tolerance
            )
            if lse is not None:
                torch.testing.assert_close(
                    lse[start : start + n].double(), want_lse, atol=tolerance, rtol=tolerance
                )
            start += n

    def refused(self, layer):
        """A random call the API or the op refuses: it must change nothing."""
        draw = self.data.draw
        q, k, v, kwargs, call = self.valid_call(layer)
        tokens = q.shape[1]
        kind = draw(st.sampled_from(sorted(REFUSALS)))
        if kind == "decode-on-a-prefill-step" and all(n == 1 for _, n in self.step):
            kind = "q-tokens"
        q, k, v, kwargs = REFUSALS[kind](self, q, k, v, kwargs, tokens)
        event(f"refused: {kind}")
        before = snapshot(self.cache)
        if kind == "strict-context":
            with attn_backend("cuda"):
                inside = contexts()
                with pytest.raises(RuntimeError, match="Explicitly-set backend 'cuda'"):
                    attention(q, k, v, **kwargs)
                assert contexts() == inside
        else:
            with pytest.raises((ValueError, RuntimeError, IndexError)):
                attention(q, k, v, **kwargs)
        assert contexts() == NO_CONTEXTS
        assert_same(before, snapshot(self.cache))


def _with(**changes):
    return lambda run, q, k, v, kwargs, tokens: (q, k, v, dict(kwargs, **changes))


REFUSALS = {
    "softcap": lambda run, q, k, v, kwargs, tokens: (
        q,
        k,
        v,
        dict(kwargs, softcap=run.data.draw(st.sampled_from([0.0, -1.0, math.nan, math.inf]))),
    ),
    "window-without-causal": _with(window_left=1, is_causal=False),
    "sinks-shape": lambda run, q, k, v, kwargs, tokens: (
        q,
        k,
        v,
        dict(kwargs, sinks=torch.zeros(run.q_heads + 1)),
    ),
    "sinks-dtype": lambda run, q, k, v, kwargs, tokens: (
        q,
        k,
        v,
        dict(kwargs, sinks=torch.zeros(run.q_heads, dtype=torch.float64)),
    ),
    "strict-argument": _with(backend="cuda"),
    "strict-context": _with(),
    "decode-on-a-prefill-step": _with(fwd="decode"),
    "q-tokens": lambda run, q, k, v, kwargs, tokens: (
        q[:, :-1] if tokens > 1 else q.repeat(1, 2, 1, 1),
        k,
        v,
        kwargs,
    ),
    "q-head-dim": lambda run, q, k, v, kwargs, tokens: (q.repeat(1, 1, 1, 2), k, v, kwargs),
    "q-dtype": lambda run, q, k, v, kwargs, tokens: (  # (an FP8 cache takes any float q)
        q.to(torch.int32) if run.fp8 else q.double(),
        k,
        v,
        kwargs,
    ),
    "k-tokens": lambda run, q, k, v, kwargs, tokens: (q, k.repeat(1, 2, 1, 1), v, kwargs),
    "mask-rows": lambda run, q, k, v, kwargs, tokens: (
        q,
        k,
        v,
        dict(kwargs, attn_mask=torch.ones(tokens + 1, 2, dtype=torch.bool)),
    ),
    "mask-dtype": lambda run, q, k, v, kwargs, tokens: (
        q,
        k,
        v,
        dict(kwargs, attn_mask=torch.ones(tokens, 2, dtype=torch.int32)),
    ),
    "scale": lambda run, q, k, v, kwargs, tokens: (
        q,
        k,
        v,
        dict(kwargs, scale=run.data.draw(st.sampled_from([math.nan, math.inf]))),
    ),
    "layer": lambda run, q, k, v, kwargs, tokens: (q, k, v, dict(kwargs, layer_id=run.layers)),
}


@RUNS
@given(st.data())
def test_refused_calls_change_nothing_and_accepted_calls_match_the_definition(data):
    run = Run(data)
    for _ in range(data.draw(st.integers(1, 5))):
        if not run.begin_step():  # no step now: a call is refused too
            q = run.randn(1, 1, run.q_heads, run.head_dim)
            k, v = (run.randn(1, 1, run.kv_heads, run.head_dim) for _ in "kv")
            before = snapshot(run.cache)
            with pytest.raises(RuntimeError, match="begin_step"):
                attention(q, k, v, kv_cache=run.cache, fwd="decode")
            assert_same(before, snapshot(run.cache))
            continue
        for layer in range(run.layers):
            for _ in range(data.draw(st.integers(0, 2))):
                run.refused(layer)
            run.accepted(layer)
    assert contexts() == NO_CONTEXTS
