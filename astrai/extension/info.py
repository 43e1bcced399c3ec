"""``python -m astrai.extension.info [--json]``: versions, how the library was built (torch,
CUDA, archs, the commit), each backend's availability with why not and the remedy, and the
capability table."""

from __future__ import annotations

import argparse
import json
import platform
from typing import List, Optional

import torch

from .._version import __version__
from . import ops
from .backend.attention import _priority_backends
from .backend.registry import BUILTIN_BACKENDS

FLASH_ATTN_INSTALL = (
    "install flash-attn>=2.6 for sm_80+ (pip install flash-attn --no-build-isolation), "
    "FlashAttention-3 (flash_attn_interface) for sm_90, or flash-attn-4 for sm_90+"
)


def remedy(name: str, available: bool) -> str:
    """What makes an unavailable backend available here ("" when it is)."""
    if available:
        return ""
    if name == "flash":
        if not torch.cuda.is_available():
            return "needs a CUDA GPU (sm_80+); then " + FLASH_ATTN_INSTALL
        return FLASH_ATTN_INSTALL
    if name == "cuda":
        if not ops.BUILD_INFO["with_cuda"]:
            if torch.version.cuda is None:
                return (
                    "install a CUDA build of torch, then rebuild astrai with nvcc (CUDA_HOME): "
                    + ops.rebuild_command()
                )
            return (
                "rebuild with nvcc (CUDA_HOME set, ASTR_FORCE_CPU unset): " + ops.rebuild_command()
            )
        return "needs an NVIDIA GPU of sm_80 or newer (the kernels are built for " + (
            ops.BUILD_INFO["cuda_archs"] + ")"
        )
    return ""


def _distribution_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("astrai")
    except Exception:
        return None


def report_data() -> dict:
    """Everything ``info`` reports, as data (``--json``)."""
    info = ops.BUILD_INFO
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            gpus.append({"name": torch.cuda.get_device_name(i), "arch": f"sm_{major}{minor}"})
    backends = []
    for cls in BUILTIN_BACKENDS:
        available = cls.available()
        backends.append(
            {
                "name": cls.name,
                "aliases": info["backends"].get(cls.name, []),
                "available": available,
                "reason": cls.status_reason(),
                "remedy": remedy(cls.name, available),
            }
        )
    return {
        "version": __version__,
        "distribution": _distribution_version(),
        "git_commit": info.get("git_commit") or None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpus": gpus,
        "build": {
            "torch": info["torch_version"],
            "with_cuda": info["with_cuda"],
            "cuda": info["cuda_version"] or None,
            "cuda_archs": [a for a in info["cuda_archs"].split(",") if a],
            "head_dims": info["paged_kernels"]["head_dims"],
        },
        "backends": backends,
        "default_order": [b.name for b in _priority_backends()],
        "variants": info["variants"],
    }


def _cuda_kernel_list() -> dict:
    """What the cuda kernels were built for (csrc/kernels/paged_attention/config.h's list)."""
    return ops.BUILD_INFO["paged_kernels"]


def capabilities() -> list:
    """The capability table; the cuda column's head dims and dtypes come from the library."""
    kernels = _cuda_kernel_list()
    head_dims = ", ".join(str(d) for d in kernels["head_dims"])
    dtypes = ", ".join(kernels["q_dtypes"])
    return [
        ("", "cuda", "flash", "torch_native"),
        ("calls", "paged prefill, decode", "dense, training, paged", "all"),
        ("devices", "CUDA sm_80+", "CUDA sm_80+ (FA3: sm_90, FA4: sm_90+)", "any SDPA device"),
        ("dtypes", dtypes, "float16, bfloat16", "float16, bfloat16, float32, float64"),
        ("head dims", head_dims, "multiples of 8 up to 256", "any"),
        ("page sizes", "1, 2, 4, ..., 256", "FA2: multiples of 256; FA3/4: any", "any"),
        ("masks", "none, causal, bool", "none, causal", "none, causal, bool, additive"),
        *_variant_rows(),
        ("gradients", "no", "dense: yes", "yes"),
    ]


def _variant_rows() -> list:
    """One row per variant: which backends implement it (csrc/dispatch/call_description.h:
    ASTR_VARIANTS, as the library reports it)."""
    return [
        (name, *("yes" if support[b] else "no" for b in ("cuda", "flash", "torch_native")))
        for name, support in ops.BUILD_INFO["variants"].items()
    ]


def report() -> str:
    info = ops.BUILD_INFO
    lines = [
        f"astrai        {__version__}"
        + (f" (installed {_distribution_version()})" if _distribution_version() else "")
        + (f", commit {info['git_commit'][:12]}" if info.get("git_commit") else ""),
        f"python        {platform.python_version()}",
        f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"gpu {i}         {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        lines.append("gpu           none visible")
    lines.append(
        f"astrai build  torch {info['torch_version']}, "
        + (
            f"CUDA {info['cuda_version']} for {info['cuda_archs']}"
            if info["with_cuda"]
            else "CPU only"
        )
    )
    lines.append("")
    lines.append(f"{'backend':<22} available  why")
    for cls in BUILTIN_BACKENDS:
        available = cls.available()
        names = ", ".join([cls.name] + info["backends"].get(cls.name, []))
        lines.append(f"{names:<22} {'yes' if available else 'no':<10} {cls.status_reason()}")
        if not available:
            lines.append(f"{'':<22} {'':<10} remedy: {remedy(cls.name, available)}")
    lines.append("default order: " + " > ".join(b.name for b in _priority_backends()))
    lines.append("")
    table = capabilities()
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m astrai.extension.info", description=__doc__)
    parser.add_argument("--json", action="store_true", help="the report as JSON")
    args = parser.parse_args(argv)
    print(json.dumps(report_data(), indent=2) if args.json else report())


if __name__ == "__main__":
    main()
