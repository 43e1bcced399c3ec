"""Builds astrai's one native library, astrai/_C.so, with torch's cpp_extension (ninja).

CUDA sources are compiled when torch has CUDA and nvcc is found; otherwise a CPU build.
The paged-attention kernels are compiled from instantiation files that
scripts/generate_instantiations.py writes into build/generated/ from the one config list
(csrc/kernels/paged_attention/config.h).

Environment:
  ASTR_FORCE_CPU=1        build without CUDA even where it is available
  TORCH_CUDA_ARCH_LIST    archs to build (default: the local GPU, else "8.0;9.0"); 9.0 is built
                          as 9.0a (wgmma)
  ASTR_HEAD_DIM=D         development build: the kernels of one head dim only (the library then
                          reports, and its resolver accepts, only that head dim)
  MAX_JOBS, NVCC_THREADS  parallelism (honoured by torch's ninja build)
"""

import glob
import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import generate_instantiations  # noqa: E402


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


def extension():
    with_cuda = want_cuda()
    cpp = sources("csrc/**/*.cpp")
    macros = [
        ("ASTR_TORCH_VERSION", f'"{torch.__version__}"'),
        ("Py_LIMITED_API", "0x03090000"),
    ]
    cxx_flags = ["-O3"]
    include_dirs = [os.path.join(ROOT, "csrc")]
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
        os.path.join(ROOT, "build", "generated"), int(only_head_dim) if only_head_dim else None
    )
    return CUDAExtension(
        "astrai._C",
        cpp + sources("csrc/**/*.cu") + [os.path.relpath(p, ROOT) for p in generated],
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        py_limited_api=True,
    )


setup(
    name="astrai",
    version="0.1.0",
    description="One attention entry point for PyTorch: paged-KV CUDA kernels, flash-attn, SDPA",
    packages=find_packages(include=["astrai", "astrai.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.9",
    install_requires=["torch>=2.5"],
)
