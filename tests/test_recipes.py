"""csrc/README.md's recipes list every file a change touches: each listed file exists, and where a
recipe names an existing instance (its probe: ``sinks`` for an argument, e5m2 for a KV-cache
dtype), every product source file that mentions it is on the list. A new file that starts to
mention ``sinks`` without joining the argument recipe fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "csrc" / "README.md"
# Product source: the library and what builds it (docs, tests, test tools and the integrations
# aside).
PRODUCT = re.compile(
    r"^(csrc/.*\.(h|cpp|cu|cuh)|astrai/.*\.py|setup\.py|scripts/generate_instantiations\.py)$"
)
INTEGRATIONS = "astrai/integrations/"


def recipes() -> dict:
    """{title: (probe or None, [paths])} from the README's "## Recipes" section."""
    text = README.read_text()
    section = text[text.index("## Recipes") :]
    found = {}
    for block in re.split(r"\n### ", section)[1:]:
        title = block.splitlines()[0].strip()
        marker = re.search(r"<!-- recipe: [^,>]*(?:, probe: (.*?))? -->", block)
        assert marker, f"recipe {title!r} has no <!-- recipe: ... --> line"
        roots = ("csrc/", "astrai/", "tests/", "scripts/", "benchmarks/")
        paths = [p for p in re.findall(r"`([^`\s]+)`", block) if p.startswith(roots)]
        found[title] = (marker.group(1), paths)
    return found


def product_files() -> list:
    """The product's source files as they are in this tree (build outputs under csrc/ or astrai/
    are none of them: .so, generated instantiations live in build/)."""
    found = [str(p.relative_to(ROOT)) for p in ROOT.glob("csrc/**/*") if p.is_file()]
    found += [str(p.relative_to(ROOT)) for p in ROOT.glob("astrai/**/*.py")]
    found += ["setup.py", "scripts/generate_instantiations.py"]
    return [p for p in found if PRODUCT.match(p) and not p.startswith(INTEGRATIONS)]


RECIPES = recipes()


def test_the_readme_has_the_recipes_a_newcomer_needs():
    titles = " | ".join(RECIPES)
    for needed in ("argument", "head dim", "KV-cache dtype", "op", "backend"):
        assert needed in titles, f"no recipe for {needed}: {titles}"


@pytest.mark.parametrize("title", list(RECIPES))
def test_every_file_a_recipe_names_exists(title):
    _, paths = RECIPES[title]
    missing = [p for p in paths if "<" not in p and not (ROOT / p).exists()]
    assert not missing, f"recipe {title!r} names files that do not exist: {missing}"


@pytest.mark.parametrize("title", [t for t, (probe, _) in RECIPES.items() if probe])
def test_a_recipe_lists_every_file_that_mentions_its_instance(title):
    probe, paths = RECIPES[title]
    pattern = re.compile(probe)
    mentioning = [p for p in product_files() if pattern.search((ROOT / p).read_text())]
    assert mentioning, f"probe {probe!r} of recipe {title!r} matches no file"
    unlisted = sorted(set(mentioning) - set(paths))
    assert not unlisted, f"recipe {title!r} does not list {unlisted}, which mention {probe!r}"


def test_adding_an_argument_touches_at_most_eight_product_files():
    _, paths = RECIPES["Add an argument to attention (a mask or score variant)"]
    numbered = [p for p in paths if PRODUCT.match(p)]
    # The flash backend's two files are named only for a variant it implements.
    core = [p for p in dict.fromkeys(numbered) if "flash" not in p]
    assert len(core) <= 8, core
