"""Compiles every .cu file under csrc/, and every instantiation that
scripts/generate_instantiations.py writes from the config list, with nvcc for sm_80 and sm_90a
(sm_90 with Hopper's arch-specific instructions, as setup.py builds it), without linking: CI's
proof that the CUDA code builds on a machine with no GPU (and with a CPU build of torch, whose
headers suffice to compile the bindings).

    python scripts/compile_cuda.py [--arch 80|90a] [PART ...]

PART: compile only the files whose path contains one of them (e.g. `paged_topk_hdim192`,
`launch.cu`); none, every file."""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from torch.utils.cpp_extension import include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
ARCHS = ("80", "90a")

import generate_instantiations  # noqa: E402


def nvcc() -> str:
    found = shutil.which("nvcc") or os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"
    )
    if not os.path.exists(found):
        sys.exit("compile_cuda: nvcc not found (set CUDA_HOME)")
    return found


def shim_include_dir() -> str:
    """A CPU build of torch ships the c10/cuda headers but not the one header that its CUDA
    build generates; supply an equivalent (it only marks c10_cuda as a shared library)."""
    shim = os.path.join(ROOT, "build-cu", "shim")
    header = os.path.join(shim, "c10", "cuda", "impl", "cuda_cmake_macros.h")
    if not os.path.exists(header):
        os.makedirs(os.path.dirname(header), exist_ok=True)
        with open(header, "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return shim


# What torch's CUDAExtension adds to every nvcc call: no implicit __half/__nv_bfloat16
# conversions or operators, so code that leans on them fails here as it would in setup.py.
TORCH_EXTENSION_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]


def compile_one(source: str, arch: str) -> tuple[str, int, str]:
    out_dir = os.path.join(ROOT, "build-cu", f"sm_{arch}")
    os.makedirs(out_dir, exist_ok=True)
    obj = os.path.join(out_dir, os.path.relpath(source, ROOT).replace(os.sep, "_") + ".o")
    cmd = [
        nvcc(),
        "-c",
        source,
        "-o",
        obj,
        "-std=c++17",
        "-O3",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-Xcompiler",
        "-fPIC",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-DASTR_WITH_CUDA=1",
        *(["-DASTR_WITH_SM90A=1"] if arch == "90a" else []),
        *TORCH_EXTENSION_FLAGS,
        "-I",
        sysconfig.get_paths()["include"],
        "-I",
        os.path.join(ROOT, "csrc"),
    ]
    for path in include_paths():
        cmd += ["-I", path]
    if not any(
        os.path.exists(os.path.join(p, "c10/cuda/impl/cuda_cmake_macros.h"))
        for p in include_paths()
    ):
        cmd += ["-I", shim_include_dir()]
    result = subprocess.run(cmd, capture_output=True, text=True)
    return f"{os.path.relpath(source, ROOT)} sm_{arch}", result.returncode, result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help="compile only paths holding one")
    parser.add_argument("--arch", choices=ARCHS, action="append", help="default: every arch")
    args = parser.parse_args()
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.cu"), recursive=True))
    sources += generate_instantiations.write(os.path.join(ROOT, "build-cu", "generated"))
    if args.parts:
        sources = [s for s in sources if any(part in s for part in args.parts)]
    if not sources:
        print("compile_cuda: no .cu files" + (f" matching {args.parts}" if args.parts else ""))
        sys.exit(1 if args.parts else 0)
    jobs = [(s, a) for s in sources for a in (args.arch or ARCHS)]
    failed = 0
    with ThreadPoolExecutor(
        max_workers=int(os.environ.get("MAX_JOBS", os.cpu_count() or 2))
    ) as pool:
        for name, code, stderr in pool.map(lambda job: compile_one(*job), jobs):
            print(("ok    " if code == 0 else "FAIL  ") + name, flush=True)
            if code != 0:
                failed += 1
                print(stderr[-4000:])
    print(f"compile_cuda: {len(jobs) - failed} compiled, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
