"""README.md's "Layout" is a tree that matches the code: every folder it names exists, and every
folder of csrc/ and astrai/ (and every top-level folder of the product) is in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_folders() -> list:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :]
    tree = section[section.index("```") + 3 : section.index("```", section.index("```") + 3)]
    folders, parents = [], {}
    for line in tree.splitlines():
        match = re.match(r"^( {0,2})([A-Za-z_]+)/\s", line + " ")
        if not match:
            continue
        depth = len(match.group(1)) // 2
        parents[depth] = match.group(2)
        folders.append("/".join(parents[d] for d in range(depth + 1)))
    return folders


def test_every_folder_the_layout_names_exists():
    folders = layout_folders()
    assert len(folders) >= 10, folders
    missing = [f for f in folders if not (ROOT / f).is_dir()]
    assert not missing, f"README.md's Layout names folders that do not exist: {missing}"


def test_every_product_folder_is_in_the_layout():
    folders = set(layout_folders())
    actual = [f"csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.is_dir()]
    actual += [
        f"astrai/{p.name}"
        for p in (ROOT / "astrai").iterdir()
        if p.is_dir() and not p.name.startswith("__")
    ]
    actual += ["csrc", "astrai", "tests", "benchmarks", "scripts"]
    unlisted = sorted(set(actual) - folders)
    assert not unlisted, f"README.md's Layout does not show {unlisted}"
