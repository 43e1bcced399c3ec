"""Builds astrai's one native library, astrai/_C.so, with torch's cpp_extension (ninja), against
the torch of the environment it runs in: the library must load into that torch, so build without
isolation (pip install --no-build-isolation ...); where torch is missing this stops at once,
saying so. Metadata is in pyproject.toml; the version in astrai/_version.py.

CUDA sources are compiled when torch has CUDA and nvcc is found; otherwise a CPU build.
The paged-attention kernels are compiled from instantiation files that
scripts/generate_instantiations.py writes into build/generated/ from the one config list
(csrc/kernels/paged_attention/config.h).

A wheel's version carries the torch and CUDA it was built for as a local version
(0.2.0+torch2.13cpu, 0.2.0+torch2.13cu128); the sdist's does not. The library records the git
commit it was built from (`info`): from git where there is a checkout, else from the GIT_COMMIT
file that the sdist carries.

Environment:
  ASTR_FORCE_CPU=1        build without CUDA even where it is available
  TORCH_CUDA_ARCH_LIST    archs to build (default: the local GPU, else "8.0;9.0"); 9.0 is built
                          as 9.0a (wgmma)
  ASTR_HEAD_DIM=D         development build: the kernels of one head dim only (the library then
                          reports, and its resolver accepts, only that head dim)
  ASTR_NO_EXTENSION=1     metadata and Python files only, no library (`make install`'s editable
                          install; the library is built in place by `make build`)
  MAX_JOBS, NVCC_THREADS  parallelism (honoured by torch's ninja build)
"""

import glob
import os
import re
import subprocess
import sys

import setuptools
from setuptools import find_packages, setup
from setuptools.command.sdist import sdist

ROOT = os.path.dirname(os.path.abspath(__file__))
GIT_COMMIT_FILE = "GIT_COMMIT"  # in the sdist: the commit it was made from
# Without isolation the build uses this environment's tools: say which are missing before
# setuptools rejects pyproject.toml's SPDX license (setuptools 77) with a schema error.
BUILD_TOOLS = "pip install 'setuptools>=77' wheel ninja"

if int(setuptools.__version__.split(".")[0]) < 77:
    sys.exit(
        f"astrai: building needs setuptools>=77 (this environment has {setuptools.__version__}); "
        f"install the build tools first: {BUILD_TOOLS}"
    )

try:
    import torch
except ImportError:
    sys.exit(
        "astrai: building needs torch installed in the environment that will run astrai (its "
        "native library is built against that torch and loads only into it). Install torch "
        "first, then build without isolation:\n"
        f"    {BUILD_TOOLS}\n"
        "    pip install --no-build-isolation .        (or the sdist: astrai-<version>.tar.gz)\n"
        "(pip's isolated build would build against a torch of its own, which yours cannot load)"
    )
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import generate_instantiations  # noqa: E402


def version() -> str:
    with open(os.path.join(ROOT, "astrai", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def want_cuda() -> bool:
    if os.environ.get("ASTR_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def cuda_archs() -> str:
    """The archs to build, with sm_90 built as sm_90a: Hopper's arch-specific target, the only one
    with wgmma (the prefill kernel's multiply); its code runs on sm_90 devices, as sm_90's would."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not archs:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            archs = f"{major}.{minor}"
        else:
            archs = "8.0;9.0"
    archs = ";".join("9.0a" if a == "9.0" else a for a in archs.replace(" ", ";").split(";") if a)
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


def sources(pattern: str) -> list[str]:
    return sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    )


def git_commit() -> str:
    """The commit being built: git's HEAD in a checkout, else the sdist's GIT_COMMIT, else ""."""
    if os.path.exists(os.path.join(ROOT, ".git")):
        try:
            return subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    try:
        with open(os.path.join(ROOT, GIT_COMMIT_FILE)) as f:
            return f.read().strip()
    except OSError:
        return ""


def write_if_changed(path: str, text: str) -> None:
    """Rewrites path only when its text changes, so that ninja rebuilds only what includes it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def write_build_commit(generated: str) -> None:
    """build/generated/astrai_build_commit.h, which only csrc/ops/build_info.cpp includes: the
    commit as a macro on every file's command line would rebuild everything at each commit."""
    write_if_changed(
        os.path.join(generated, "astrai_build_commit.h"),
        f'#define ASTR_GIT_COMMIT "{git_commit()}"\n',
    )


def built_for(with_cuda: bool) -> str:
    """The local version of a wheel: the torch (major.minor) and CUDA it was built for."""
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    cuda = "cu" + torch.version.cuda.replace(".", "") if with_cuda else "cpu"
    return f"torch{major_minor}{cuda}"


def extension():
    with_cuda = want_cuda()
    cpp = sources("csrc/**/*.cpp")
    generated_dir = os.path.join(ROOT, "build", "generated")
    write_build_commit(generated_dir)
    macros = [
        ("ASTR_TORCH_VERSION", f'"{torch.__version__}"'),
        ("Py_LIMITED_API", "0x03090000"),
    ]
    cxx_flags = ["-O3"]
    include_dirs = [os.path.join(ROOT, "csrc"), generated_dir]
    only_head_dim = os.environ.get("ASTR_HEAD_DIM")
    if only_head_dim:
        macros.append(("ASTR_ONLY_HEAD_DIM", str(int(only_head_dim))))
    if not with_cuda:
        return CppExtension(
            "astrai._C",
            cpp,
            include_dirs=include_dirs,
            define_macros=macros,
            extra_compile_args={"cxx": cxx_flags},
            py_limited_api=True,
        )
    archs = cuda_archs()
    macros += [
        ("ASTR_WITH_CUDA", "1"),
        ("ASTR_CUDA_VERSION", f'"{torch.version.cuda}"'),
        (
            "ASTR_CUDA_ARCHS",
            '"' + ",".join("sm_" + a.replace(".", "") for a in archs.split(";")) + '"',
        ),
    ]
    if "9.0a" in archs.split(";"):
        macros.append(("ASTR_WITH_SM90A", "1"))
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    threads = os.environ.get("NVCC_THREADS")
    if threads:
        nvcc_flags.append(f"--threads={threads}")
    generated = generate_instantiations.write(
        generated_dir, int(only_head_dim) if only_head_dim else None
    )
    return CUDAExtension(
        "astrai._C",
        cpp + sources("csrc/**/*.cu") + [os.path.relpath(p, ROOT) for p in generated],
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        py_limited_api=True,
    )


class SdistWithCommit(sdist):
    """The sdist also carries GIT_COMMIT, so that a library built from it reports its commit."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        commit = git_commit()
        if commit:
            with open(os.path.join(base_dir, GIT_COMMIT_FILE), "w") as f:
                f.write(commit + "\n")


def building_sdist() -> bool:
    return "sdist" in sys.argv[1:]


with_extension = os.environ.get("ASTR_NO_EXTENSION", "0") != "1" and not building_sdist()
setup(
    # The sdist is torch-neutral; everything built from it says which torch it was built for.
    version=version() if building_sdist() else f"{version()}+{built_for(want_cuda())}",
    packages=find_packages(include=["astrai", "astrai.*"]),
    ext_modules=[extension()] if with_extension else [],
    cmdclass={
        "build_ext": BuildExtension.with_options(use_ninja=True),
        "sdist": SdistWithCommit,
    },
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
