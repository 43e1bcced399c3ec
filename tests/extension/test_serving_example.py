"""README.md's example for serving engines (a verify step of trees of drafts, then the
batch-invariant switch) runs as written, on the CPU, and gives the definition's answer."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import astrai
from tests.reference import paged_reference

README = Path(__file__).resolve().parents[2] / "README.md"


def example_code() -> str:
    text = README.read_text()
    block = re.search(
        r"<!-- serving example begin -->\s*```python\n(.*?)```\s*<!-- serving example end -->",
        text,
        re.S,
    )
    assert block, "README.md has no serving example between its markers"
    return block.group(1)


def test_the_serving_example_runs_and_verifies_the_trees():
    scope: dict = {}
    exec(compile(example_code(), str(README), "exec"), scope)
    out, cache, step, tree_mask = scope["out"], scope["cache"], scope["step"], scope["tree_mask"]
    assert out.shape == (1, 7, 8, 64)
    # The verify step's metadata and the drafts' k/v stay where they were written.
    ref = paged_reference(
        scope["q"][0],
        cache.k_pools[0],
        cache.v_pools[0],
        step.block_table,
        step.seq_lens,
        step.query_start_loc,
        is_causal=True,
        tree_mask=tree_mask,
    )
    torch.testing.assert_close(out[0].double(), ref, atol=2e-5, rtol=2e-5)
    assert scope["alone"].shape == (1, 1, 8, 64)
    assert astrai.batch_invariant() is False
