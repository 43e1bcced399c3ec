"""``python -m astrai.extension.info``: versions, how the library was built, each backend's
availability (and why not), and the capability table."""

from __future__ import annotations

import platform

import torch

from . import ops
from .backend.attention import _priority_backends
from .backend.registry import BUILTIN_BACKENDS


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
    lines = [
        f"python        {platform.python_version()}",
        f"torch         {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"gpu {i}         {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        lines.append("gpu           none visible")
    info = ops.BUILD_INFO
    lines.append(
        f"astrai build  torch {info['torch_version']}, "
        + (
            f"CUDA {info['cuda_version']} for {info['cuda_archs']}"
            if info["with_cuda"]
            else "CPU only"
        )
    )
    rows = [(cls.name, cls.available(), cls.status_reason()) for cls in BUILTIN_BACKENDS]
    lines.append("")
    lines.append("backend        available  why")
    for name, available, why in rows:
        lines.append(f"{name:<14} {'yes' if available else 'no':<10} {why}")
    lines.append("default order: " + " > ".join(b.name for b in _priority_backends()))
    lines.append("")
    table = capabilities()
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
