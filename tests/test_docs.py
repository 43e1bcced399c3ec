"""The documents say what the code does: every ```python block of README.md runs as written
(unless the line before it says ``<!-- not run: why -->``), and the op signatures in README.md
and csrc/README.md are the registered schemas'."""

from __future__ import annotations

import os
import re

import pytest
import torch

import astrai.extension  # noqa: F401  (loads the library: torch.ops.astr)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_RUN = re.compile(r"<!-- not run: .+ -->")


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def python_blocks(text: str):
    """(line number, code, marked not run) for each ```python block."""
    lines = text.split("\n")
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            start = index
            end = lines.index("```", index + 1)
            marked = start > 0 and bool(NOT_RUN.fullmatch(lines[start - 1].strip()))
            blocks.append((start + 1, "\n".join(lines[start + 1 : end]), marked))
            index = end
        index += 1
    return blocks


README_BLOCKS = python_blocks(read("README.md"))


def test_readme_has_blocks_that_run():
    assert sum(not marked for _, _, marked in README_BLOCKS) >= 3


@pytest.mark.parametrize(
    "line, code, marked", README_BLOCKS, ids=[f"README.md:{b[0]}" for b in README_BLOCKS]
)
def test_readme_python_block_runs_as_written(line, code, marked):
    if marked:
        pytest.skip("marked <!-- not run: ... --> in README.md")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme_block"})


def schema_arguments(op) -> list:
    return [a.name for a in op._schema.arguments]


def test_readme_op_signature_is_the_registered_schema():
    text = read("README.md")
    marker = text.index("<!-- op signature -->")
    line = text[marker:].split("\n")[1]
    names = re.fullmatch(r"`torch\.ops\.astr\.attention\(([^)]*)\)`;?", line.strip()).group(1)
    assert [n.strip() for n in names.split(",")] == schema_arguments(
        torch.ops.astr.attention.default
    )


@pytest.mark.parametrize(
    "name, op",
    [
        ("append_kv", torch.ops.astr.append_kv.default),
        ("merge_states", torch.ops.astr.merge_states.default),
    ],
)
def test_readme_companion_ops_take_the_schemas_arguments(name, op):
    text = " ".join(read("README.md").split())
    for call in re.findall(rf"`torch\.ops\.astr\.{name}\(([^)]*)\)`", text):
        assert [n.strip() for n in call.split(",")] == schema_arguments(op)


def test_readme_latent_ops_take_the_schemas_arguments():
    """README.md's mla_attention and append_mla calls list the schemas' arguments, in order
    (issue 50's names are a client's contract)."""
    text = " ".join(read("README.md").split())
    for name, op in (
        ("mla_attention", torch.ops.astr.mla_attention.default),
        ("append_mla", torch.ops.astr.append_mla.default),
    ):
        calls = re.findall(rf"`torch\.ops\.astr\.{name}\(([^)]*)\)`", text)
        assert calls, f"README.md shows no torch.ops.astr.{name}(...) call"
        for call in calls:
            assert [n.split("=")[0].strip() for n in call.split(",")] == schema_arguments(op)


def csrc_readme_signature(name: str) -> list:
    """The argument names of csrc/README.md's bullet "- `name(args) -> ...`", '?' and
    defaults stripped, in order."""
    match = re.search(rf"- `{name}\(([^`]*)`", " ".join(read("csrc/README.md").split()))
    assert match, f"csrc/README.md has no bullet for {name}"
    listed = re.match(r"(.*?)\)(?: -> .*)?$", match.group(1)).group(1)
    names = []
    for argument in listed.split(","):
        argument = argument.strip()
        if argument in ("*", ""):
            continue
        names.append(re.match(r"[A-Za-z_]+", argument).group(0))
    return names


@pytest.mark.parametrize(
    "name, op",
    [
        ("attention", torch.ops.astr.attention.default),
        ("merge_states", torch.ops.astr.merge_states.default),
        ("append_kv", torch.ops.astr.append_kv.default),
        ("mla_attention", torch.ops.astr.mla_attention.default),
        ("append_mla", torch.ops.astr.append_mla.default),
    ],
)
def test_csrc_readme_signatures_are_the_registered_schemas(name, op):
    assert csrc_readme_signature(name) == schema_arguments(op)


def test_csrc_readme_marks_the_optional_arguments():
    text = " ".join(read("csrc/README.md").split())
    listed = re.search(r"- `attention\(([^`]*)\) -> Tensor`", text).group(1)
    marked = {a.strip().rstrip("?").split("=")[0] for a in listed.split(",") if "?" in a}
    optional = {
        a.name
        for a in torch.ops.astr.attention.default._schema.arguments
        if isinstance(a.type, torch.OptionalType)
    }
    assert marked == optional
