"""astrai.extension.selection: what a call through the Python API observes, and the two small
functions that speak the op's selection arguments (``op_selection_args``) and read
``selected_backend()`` (``parse_selected_backend``), checked against the op itself."""

from __future__ import annotations

import json

import pytest
import torch

from astrai import AttentionBackend, attention, attn_backend, explain
from astrai.extension.selection import (
    DEFAULT_SELECTION,
    BackendSource,
    observe,
    op_selection_args,
    parse_selected_backend,
    thread_selection,
)

Q, K, V = (torch.randn(1, 3, 2, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))


@pytest.fixture(autouse=True)
def no_environment_backend(monkeypatch):
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    yield
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    assert thread_selection() == (None, BackendSource.DEFAULT)


class Echo(AttentionBackend):
    def fwd_prefill(self, q, k, v, kv_cache=None, layer_id=0, attn_mask=None, is_causal=False):
        return q


def test_backend_sources_are_numbered_as_the_op_will_take_them():
    assert {source.name: int(source) for source in BackendSource} == {
        "NOT_GIVEN": 0,
        "ARGUMENT": 1,
        "CONTEXT": 2,
        "ENVIRONMENT": 3,
        "DEFAULT": 4,
    }


@pytest.mark.parametrize(
    "source, requested",
    [
        (BackendSource.ARGUMENT, "torch_native"),
        (BackendSource.CONTEXT, "torch_native"),
        (BackendSource.ENVIRONMENT, "torch_native"),
        (BackendSource.DEFAULT, ""),
    ],
)
def test_the_op_reads_the_selection_arguments_as_written(source, requested):
    args = op_selection_args(source, requested or None)
    with attn_backend("cuda"):  # on the thread's stack: the op must not read it
        decision = json.loads(torch.ops.astr.explain(Q, K, V, **args))
    assert (decision["source"], decision["requested"]) == (source.name.lower(), requested)


def test_not_given_lets_the_op_read_the_thread_and_environment_itself(monkeypatch):
    args = op_selection_args(BackendSource.NOT_GIVEN, None)
    with attn_backend("cuda"):
        decision = json.loads(torch.ops.astr.explain(Q, K, V, **args))
    assert (decision["source"], decision["requested"]) == ("context", "cuda")
    monkeypatch.setenv("ASTR_BACKEND", "flash")
    decision = json.loads(torch.ops.astr.explain(Q, K, V, **args))
    assert (decision["source"], decision["requested"]) == ("environment", "flash")


def test_parse_reads_what_the_op_reports_for_the_thread(monkeypatch):
    assert parse_selected_backend(torch.ops.astr.selected_backend()) == (
        None,
        BackendSource.DEFAULT,
    )
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    assert thread_selection() == ("torch_native", BackendSource.ENVIRONMENT)
    with attn_backend(Echo()):
        assert thread_selection() == ("python:Echo", BackendSource.CONTEXT)


def test_parse_reads_the_schemas_pair():
    assert parse_selected_backend(("cuda", 2)) == ("cuda", BackendSource.CONTEXT)
    assert parse_selected_backend(("", 4)) == (None, BackendSource.DEFAULT)


def test_observe_resolves_each_rule(monkeypatch):
    assert observe() is DEFAULT_SELECTION
    monkeypatch.setenv("ASTR_BACKEND", "torch_native")
    assert observe()[:2] == (BackendSource.ENVIRONMENT, "torch_native")
    monkeypatch.setenv("ASTR_BACKEND", "no-such-backend")  # passed on: the op warns about it
    assert observe()[:2] == (BackendSource.ENVIRONMENT, "no-such-backend")
    with attn_backend("cuda") as cuda:
        selection = observe()
        assert selection[:3] == (BackendSource.CONTEXT, "cuda", cuda)
        assert selection.python_backend is None
        argument = observe("torch_native")
        assert argument[:2] == (BackendSource.ARGUMENT, "torch_native")
    echo = Echo()
    python = observe(echo)
    assert (python.source, python.name, python.python_backend) == (
        BackendSource.ARGUMENT,
        "python:Echo",
        echo,
    )


def test_eager_api_calls_hand_the_op_their_own_selection():
    """A raw push onto the thread's C++ stack is seen by direct op calls only: the Python API
    passes what the calling task observed (here: no context, the default)."""
    entry = torch.ops.astr.push_backend("cuda")
    try:
        assert explain(Q, K, V).source == "default"
        assert json.loads(torch.ops.astr.explain(Q, K, V))["source"] == "context"
    finally:
        torch.ops.astr.pop_backend(entry)


def test_a_backend_object_enters_through_attn_backend():
    echo = Echo()
    with echo as entered:
        assert entered is echo
        assert observe().backend is echo
        assert thread_selection() == ("python:Echo", BackendSource.CONTEXT)
    with pytest.raises(RuntimeError, match="is not an open context"):
        echo.__exit__(None, None, None)


def test_a_python_backend_refuses_a_scale_it_would_not_apply():
    """Such a backend's forward takes no scale and applies 1/sqrt(head_dim): that scale is
    accepted, any other raises naming it instead of being ignored."""
    q = torch.randn(1, 3, 2, 16)
    assert attention(q, q, q, backend=Echo(), scale=16**-0.5) is q
    with pytest.raises(ValueError, match="Echo is written in Python: scale run only"):
        attention(q, q, q, backend=Echo(), scale=0.3)
    with pytest.raises(ValueError, match="softcap, sinks run only"):
        attention(q, q, q, backend=Echo(), softcap=5.0, sinks=torch.zeros(2))
