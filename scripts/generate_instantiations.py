"""Writes the paged-attention instantiation files from the one config list,
csrc/kernels/paged_attention/config.h: one .cu per family, head dim, q dtype and kv kind, each
holding one explicit instantiation of a launch template declared in instantiations.h. setup.py
(the build) and scripts/compile_cuda.py (CI's compile check) call it; nothing it writes is checked
in.

    python scripts/generate_instantiations.py OUT_DIR [--head-dim D]

--head-dim (setup.py passes ASTR_HEAD_DIM) writes one head dim only: the development build.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "csrc", "kernels", "paged_attention", "config.h")


@dataclass(frozen=True)
class HeadDim:
    head_dim: int
    head_dim_v: int
    decode_block_pairs: bool
    decode_eight_warps: bool
    decode_persistent: bool
    prefill_wgmma: bool
    prefill_warp_specialized: bool
    prefill_persistent: bool
    topk: bool


@dataclass(frozen=True)
class QType:
    enumerator: str
    cuda_type: str
    short: str  # file-name part


@dataclass(frozen=True)
class KVKind:
    enumerator: str
    cuda_type: Optional[str]  # None: q's own type
    short: str


def _between(text: str, begin: str, end: str) -> str:
    start = text.index(begin) + len(begin)
    return text[start : text.index(end, start)]


def read_config(path: str = CONFIG):
    text = open(path).read()
    head_dims: List[HeadDim] = []
    for row in re.finditer(r"\{([^{}]*)\}", _between(text, "BEGIN HEAD DIMS", "END HEAD DIMS")):
        cells = [c.strip() for c in row.group(1).split(",")]
        head_dims.append(HeadDim(int(cells[0]), int(cells[1]), *[c == "true" for c in cells[2:9]]))
    q_types = [
        QType(m.group(1), m.group(2), "bf16" if "bfloat16" in m.group(2) else "fp16")
        for m in re.finditer(
            r"X\((\w+),\s*([\w:]+),\s*\"[\w]+\"\)",
            _between(text, "#define ASTR_PAGED_Q_TYPES(X)", "\n\n"),
        )
    ]
    kv_kinds = [
        KVKind(m.group(1), None if m.group(2) == "Q" else m.group(2), m.group(3))
        for m in re.finditer(
            r"X\((\w+),\s*([\w:]+),\s*(\w+)\)",
            _between(text, "#define ASTR_PAGED_KV_KINDS(X)", "\n\n"),
        )
    ]
    if not head_dims or not q_types or not kv_kinds:
        sys.exit(f"generate_instantiations: could not read the lists in {path}")
    return head_dims, q_types, kv_kinds


# The families that read an FP8 cache themselves (config.h: ASTR_PAGED_KV_KINDS; plan.h:
# prefill_reads_fp8).
FP8_FAMILIES = ("paged_decode", "paged_prefill", "paged_prefill_wgmma", "paged_topk")

# The families whose launch template takes v's head dim after q/k's (<D, DV, T, KV>); the others
# take equal dims (<D, T, KV>), and config.h compiles them for rows of equal dims only.
V_HEAD_DIM_FAMILIES = ("paged_decode", "paged_prefill", "paged_topk")

FAMILIES = {
    # family: (header, launch template, its extra parameters, the config flag it needs)
    "paged_decode": (
        "decode_kernel.cuh",
        "run_paged_decode",
        "const PagedKernelArgs&, DecodeForm, cudaStream_t",
        None,
    ),
    "paged_topk": (
        "topk_attention_kernel.cuh",
        "run_paged_topk",
        "const PagedKernelArgs&, cudaStream_t",
        "topk",
    ),
    "paged_decode_persistent": (
        "decode_persistent_kernel.cuh",
        "run_paged_decode_persistent",
        "const PagedKernelArgs&, cudaStream_t",
        "decode_persistent",
    ),
    "paged_prefill": (
        "prefill_mma_sync_kernel.cuh",
        "run_paged_prefill",
        "const PagedKernelArgs&, cudaStream_t",
        None,
    ),
    "paged_prefill_wgmma": (
        "prefill_wgmma_kernel.cuh",
        "run_paged_prefill_wgmma",
        "const PagedKernelArgs&, cudaStream_t",
        "prefill_wgmma",
    ),
    "paged_prefill_warp_specialized": (
        "prefill_warp_specialized_kernel.cuh",
        "run_paged_prefill_warp_specialized",
        "const PagedKernelArgs&, cudaStream_t",
        "prefill_warp_specialized",
    ),
    "paged_prefill_persistent": (
        "prefill_persistent_kernel.cuh",
        "run_paged_prefill_persistent",
        "const PagedKernelArgs&, cudaStream_t",
        "prefill_persistent",
    ),
}


def instantiations(only_head_dim: Optional[int] = None):
    """(file name, text) of every instantiation the config asks for."""
    head_dims, q_types, kv_kinds = read_config()
    files = []
    for hd in head_dims:
        if only_head_dim is not None and hd.head_dim != only_head_dim:
            continue
        # "hdim128", or "hdim192_v128" where v's head dim differs.
        dims_name = f"hdim{hd.head_dim}" + (
            f"_v{hd.head_dim_v}" if hd.head_dim_v != hd.head_dim else ""
        )
        for family, (header, template, params, flag) in FAMILIES.items():
            if flag is not None and not getattr(hd, flag):
                continue
            if family in V_HEAD_DIM_FAMILIES:
                dims_args = f"{hd.head_dim}, {hd.head_dim_v}"
            elif hd.head_dim_v == hd.head_dim:
                dims_args = f"{hd.head_dim}"
            else:
                sys.exit(f"generate_instantiations: {family} takes equal head dims, not {hd}")
            for q in q_types:
                for kv in kv_kinds:
                    if kv.cuda_type is not None and family not in FP8_FAMILIES:
                        continue
                    kv_type = kv.cuda_type or q.cuda_type
                    name = f"{family}_{dims_name}_{q.short}_kv_{kv.short}.cu"
                    text = (
                        f"// Generated by scripts/generate_instantiations.py from config.h: "
                        f"{family}, head dims {dims_args},\n// q {q.short}, kv {kv.short}. "
                        f"Do not edit.\n"
                        f'#include "kernels/paged_attention/{header}"\n\n'
                        f"namespace astr::kernels {{\n"
                        f"template LaunchStatus {template}<{dims_args}, {q.cuda_type}, "
                        f"{kv_type}>({params});\n"
                        f"}}  // namespace astr::kernels\n"
                    )
                    files.append((name, text))
    return files


def write(out_dir: str, only_head_dim: Optional[int] = None) -> List[str]:
    """Writes the files into out_dir (rewriting only those whose text changed, so that ninja does
    not rebuild them), removes stale ones, and returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, text in instantiations(only_head_dim):
        path = os.path.join(out_dir, name)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
        paths.append(path)
    for stale in set(os.listdir(out_dir)) - {os.path.basename(p) for p in paths}:
        if stale.endswith(".cu"):
            os.remove(os.path.join(out_dir, stale))
    if not paths:
        sys.exit(f"generate_instantiations: head dim {only_head_dim} is not in {CONFIG}")
    return sorted(paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--head-dim", type=int, default=None)
    args = parser.parse_args()
    for path in write(args.out_dir, args.head_dim):
        print(path)


if __name__ == "__main__":
    main()
