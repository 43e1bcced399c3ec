"""astrai installs as a package: one version, a license, an sdist that carries what the build
needs, an isolated build that stops at once saying why, a library that refuses another torch by
naming both and the rebuild, and ``import astrai`` that costs nothing until the API is used."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def run_python(code: str, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, **env_extra)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )


def test_one_version_exported_released_and_changelogged():
    import astrai
    from astrai._version import __version__

    assert astrai.__version__ == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert f"\n## {__version__}\n" in read("CHANGELOG.md")
    assert 'dynamic = ["version"]' in read("pyproject.toml")


def test_apache_license_in_full_and_in_the_metadata():
    text = read("LICENSE")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10_000
    assert 'license = "Apache-2.0"' in read("pyproject.toml")


def test_import_astrai_loads_neither_torch_nor_the_library_until_used():
    result = run_python(
        "import sys, astrai; print('torch' in sys.modules, astrai.__version__); "
        "astrai.attention; print('torch' in sys.modules, hasattr(sys.modules['torch'].ops, 'astr'))"
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("\n")[:2]
    assert first.startswith("False ")
    assert second == "True True"


def test_demo_help_imports_neither_torch_nor_transformers():
    code = (
        "import sys, runpy; sys.argv = ['astrai.demo', '--help']\n"
        "try:\n    runpy.run_module('astrai.demo', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('loaded:', 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "loaded: False False" in result.stdout
    assert "--paged" in result.stdout and "--model" in result.stdout
    # the description is the docstring's whole first paragraph, not a cut sentence
    assert "own attention, and check that they choose the same greedy tokens." in result.stdout


def test_an_isolated_build_without_torch_stops_at_once_saying_what_to_do(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no torch in this environment')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "--no-build-isolation" in result.stderr and "torch" in result.stderr


def test_the_sdist_carries_what_the_build_needs(tmp_path):
    result = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    (archive,) = list(tmp_path.glob("astrai-*.tar.gz"))
    from astrai._version import __version__

    assert archive.name == f"astrai-{__version__}.tar.gz"  # torch-neutral: no local version
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(
        ["git", "ls-files", "csrc"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    missing = [
        p
        for p in tracked
        + [
            "scripts/generate_instantiations.py",
            "setup.py",
            "pyproject.toml",
            "LICENSE",
            "README.md",
            "GIT_COMMIT",
        ]
        if p not in names
    ]
    assert not missing
    assert not [n for n in names if n.startswith("tests/") or n.endswith((".so", ".o"))]


def test_a_library_built_for_another_torch_names_both_and_the_rebuild():
    import astrai.extension  # noqa: F401
    from astrai.extension import ops

    info = dict(ops.BUILD_INFO, torch_version="2.11.0+cu128", with_cuda=True, cuda_version="12.8")
    with pytest.raises(ImportError) as raised:
        ops.check_built_for_this_torch(info, installed="2.13.0+cpu")
    message = str(raised.value)
    assert "built for torch 2.11.0+cu128 (CUDA 12.8 kernels)" in message
    assert "torch 2.13.0+cpu is installed" in message
    assert "build_ext --inplace" in message or "--no-build-isolation" in message


def test_wheel_version_names_the_torch_and_cuda_it_was_built_for():
    result = subprocess.run(
        [sys.executable, "setup.py", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, ASTR_FORCE_CPU="1"),
    )
    import torch

    from astrai._version import __version__

    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert result.stdout.strip().splitlines()[-1] == f"{__version__}+torch{major_minor}cpu"
