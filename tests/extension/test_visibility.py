"""Dispatch made visible: the ``astrai`` logger (one line per call form, with the backend),
profiler ranges named after the choice, ``info --json`` with a remedy per unavailable backend,
``sdpa`` as torch_native's other name, and ``return_lse=False`` meaning no LSE."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import astrai
from astrai.extension import info, visibility

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh_forms(monkeypatch):
    """Each test sees every call form for the first time."""
    monkeypatch.setattr(visibility, "_CHOICES", {})
    monkeypatch.setattr(visibility, "_KERNELS", {})


def qkv(*shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape))
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3)]


def test_the_logger_says_once_per_call_form_which_backend_ran(caplog, fresh_forms):
    q, k, v = qkv(2, 8, 4, 16)
    with caplog.at_level(logging.INFO, logger="astrai"):
        astrai.attention(q, k, v, is_causal=True)
        astrai.attention(*qkv(3, 5, 4, 16), is_causal=True)  # other sizes: the same form
        astrai.attention(q, k, v)  # not causal: another form
    lines = [r.getMessage() for r in caplog.records if r.name == "astrai"]
    assert len(lines) == 2, lines
    assert "dense training float32 cpu q[*,*,4,16] is_causal -> torch_native (default)" in lines[0]
    assert "is_causal" not in lines[1] and "-> torch_native" in lines[1]


def test_the_logger_names_the_source_of_the_choice(caplog, fresh_forms):
    q, k, v = qkv(1, 4, 2, 8)
    with caplog.at_level(logging.INFO, logger="astrai"), astrai.attn_backend("sdpa"):
        astrai.attention(q, k, v)
    assert "-> torch_native (context)" in caplog.records[-1].getMessage()


def test_nothing_is_observed_below_info_without_a_profiler(monkeypatch, fresh_forms):
    def observed(*args, **kwargs):
        raise AssertionError("a call was observed while nobody looks")

    monkeypatch.setattr(visibility, "run_visibly", observed)
    logging.getLogger("astrai").setLevel(logging.WARNING)
    try:
        astrai.attention(*qkv(1, 4, 2, 8))
    finally:
        logging.getLogger("astrai").setLevel(logging.NOTSET)


def test_profiler_ranges_are_named_after_the_choice(fresh_forms):
    q, k, v = qkv(1, 6, 2, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        astrai.attention(q, k, v, is_causal=True)
    names = {event.name for event in profile.events()}
    assert "astr::attention[torch_native]" in names


def test_a_refused_call_raises_the_ops_own_error_under_the_logger(caplog, fresh_forms):
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 4, 2, 8)  # 3 query heads over 2 kv heads
    with caplog.at_level(logging.INFO, logger="astrai"), pytest.raises(RuntimeError, match="head"):
        astrai.attention(q, k, k)


def test_astr_loglevel_sets_the_level_and_prints_to_stderr():
    code = (
        "import torch, astrai; q = torch.randn(1, 4, 2, 8); astrai.attention(q, q, q); "
        "astrai.attention(q, q, q)"
    )
    env = dict(os.environ, ASTR_LOGLEVEL="info", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("astrai INFO")]
    assert len(lines) == 1 and "-> torch_native" in lines[0], result.stderr


def test_astr_loglevel_that_is_no_level_raises_naming_it():
    env = dict(os.environ, ASTR_LOGLEVEL="loud", PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, "-c", "import astrai; astrai.attention"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "ASTR_LOGLEVEL='loud'" in result.stderr


# -- info --json ------------------------------------------------------------------------------


def test_info_json_reports_version_build_and_a_remedy_per_unavailable_backend(capsys):
    info.main(["--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == astrai.__version__
    assert data["build"]["torch"] == torch.__version__
    assert data["git_commit"] is None or len(data["git_commit"]) == 40
    by_name = {b["name"]: b for b in data["backends"]}
    assert list(by_name) == ["cuda", "flash", "torch_native"]
    assert by_name["torch_native"]["available"] and by_name["torch_native"]["aliases"] == ["sdpa"]
    for backend in data["backends"]:
        assert bool(backend["remedy"]) != backend["available"], backend
    if not by_name["flash"]["available"]:
        assert "flash-attn>=" in by_name["flash"]["remedy"]
    if not by_name["cuda"]["available"] and not data["build"]["with_cuda"]:
        assert "rebuild" in by_name["cuda"]["remedy"] and "nvcc" in by_name["cuda"]["remedy"]


def test_info_text_shows_the_version_and_remedies():
    text = info.report()
    assert text.startswith(f"astrai        {astrai.__version__}")
    assert "torch_native, sdpa" in text


# -- sdpa, torch_native's other name --------------------------------------------------------


def test_sdpa_names_torch_native_in_a_context_an_argument_and_the_environment(monkeypatch):
    q, k, v = qkv(1, 4, 2, 8)
    with astrai.attn_backend("sdpa") as backend:
        assert backend is astrai.AttentionBackendFactory.create("torch_native")
        assert astrai.explain(q, k, v).backend == "torch_native"
    decision = astrai.explain(q, k, v, backend="sdpa")
    assert (decision.backend, decision.source) == ("torch_native", "argument")
    out = torch.ops.astr.attention(q, k, v, backend="sdpa")
    torch.testing.assert_close(out, astrai.attention(q, k, v))
    monkeypatch.setenv("ASTR_BACKEND", "sdpa")
    decision = astrai.explain(q, k, v)
    assert (decision.backend, decision.source, decision.requested) == (
        "torch_native",
        "environment",
        "torch_native",
    )


def test_an_unknown_name_lists_sdpa_among_the_valid_ones():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"torch_native \(or sdpa\)"):
        torch.ops.astr.attention(q, q, q, backend="sdp")
    with pytest.raises(ValueError, match=r"sdpa \(= torch_native\)"):
        astrai.attn_backend("sdp")


# -- return_lse=False ----------------------------------------------------------------------


def test_return_lse_false_on_the_op_means_no_lse():
    q, k, v = qkv(2, 5, 2, 8)
    out, lse = torch.ops.astr.attention(q, k, v, is_causal=True, return_lse=False)
    assert torch.equal(out, torch.ops.astr.attention(q, k, v, is_causal=True))
    assert lse.numel() == 0 and lse.dtype == torch.float32
    with_lse, lse = torch.ops.astr.attention(q, k, v, is_causal=True, return_lse=True)
    torch.testing.assert_close(with_lse, out)  # (the LSE path computes its own way)
    assert lse.shape == (2, 5, 2)


def test_return_lse_false_through_the_api_returns_out_alone():
    q, k, v = qkv(2, 5, 2, 8)
    out = astrai.attention(q, k, v, return_lse=False)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
