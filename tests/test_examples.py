"""Every script in examples/ runs as a user would run it (a fresh process, from another folder),
and exits 0: each checks its own results against a float64 reference or a second computation."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))


def test_there_are_examples():
    names = {os.path.basename(path) for path in EXAMPLES}
    assert {
        "dense_training.py",
        "paged_decode.py",
        "variants.py",
        "fp8_cache.py",
        "merge_states.py",
        "context_parallel.py",
        "switch_from_flash_attn.py",
    } <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for variable in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)  # the context-parallel example runs as one rank
    result = subprocess.run(
        [sys.executable, path], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip(), "an example says what it did"
