"""Loads astrai's native library once, checks it matches this torch, and registers the fake
(meta) kernels of the ops that have device kernels, beside their typed wrappers.

Every other module reaches the native ops through this one.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rebuild_command() -> str:
    """How to rebuild the library against the installed torch: in place in a source checkout,
    else by reinstalling astrai from its source (a checkout or the sdist) without isolation."""
    source = os.path.dirname(_PACKAGE_DIR)
    if os.path.exists(os.path.join(source, "setup.py")):
        return f"cd {source} && python setup.py build_ext --inplace (or: make build)"
    return (
        "pip install --no-build-isolation --force-reinstall --no-deps <astrai's source folder "
        "or astrai-<version>.tar.gz>"
    )


def _built_for() -> str:
    """The torch and CUDA the installed distribution says it was built for (its local version,
    e.g. "torch2.13cpu"), or "" (a checkout's build, or no metadata)."""
    try:
        from importlib.metadata import version

        return version("astrai").partition("+")[2]
    except Exception:
        return ""


def _load_library() -> dict:
    candidates = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_C*.so")))
    if not candidates:
        raise ImportError(
            f"astrai: native library astrai/_C*.so not found; build it with: {rebuild_command()}"
        )
    try:
        torch.ops.load_library(candidates[0])
    except OSError as error:
        built_for = _built_for()
        raise ImportError(
            f"astrai: could not load {candidates[0]} ({error}); it was probably built for "
            f"another torch ({built_for or 'see pip show astrai'}) than the installed torch "
            f"{torch.__version__} (CUDA {torch.version.cuda or 'none'}); rebuild it for this "
            f"torch: {rebuild_command()}"
        ) from error
    info = json.loads(torch.ops.astr.build_info())
    check_built_for_this_torch(info)
    return info


def check_built_for_this_torch(info: dict, installed: str = torch.__version__) -> None:
    """Raises ImportError naming both torch versions and the rebuild command unless the library
    (``info``: its build_info) was built for the ``installed`` torch."""
    if info["torch_version"] == installed:
        return
    built_kernels = f"CUDA {info['cuda_version']} kernels" if info["with_cuda"] else "CPU only"
    raise ImportError(
        f"astrai: the native library was built for torch {info['torch_version']} "
        f"({built_kernels}) but torch {installed} is installed; rebuild it for this torch: "
        f"{rebuild_command()}"
    )


BUILD_INFO: dict = _load_library()


# astr::cuda_paged_attention takes astr::attention's arguments (csrc/ops/attention_args.h), bound
# here by name so that this fake follows that list.
_CUDA_OP_ARGS = tuple(
    argument.name for argument in torch.ops.astr.cuda_paged_attention.default._schema.arguments
)


@torch.library.register_fake("astr::cuda_paged_attention")
def _cuda_paged_attention_fake(*args, **kwargs):
    call = dict(zip(_CUDA_OP_ARGS, args), **kwargs)
    q, v_cache = call["q"], call["v_cache"]
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[3])
    lse_shape = (q.shape[0], q.shape[1]) if call.get("return_lse", False) else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


# astr::cuda_mla_attention takes astr::mla_attention's arguments (csrc/ops/mla_attention_args.h):
# out [T, H, Dc] in q_nope's dtype; lse [T, H] float32 only with return_lse.
_CUDA_MLA_OP_ARGS = tuple(
    argument.name for argument in torch.ops.astr.cuda_mla_attention.default._schema.arguments
)


@torch.library.register_fake("astr::cuda_mla_attention")
def _cuda_mla_attention_fake(*args, **kwargs):
    call = dict(zip(_CUDA_MLA_OP_ARGS, args), **kwargs)
    q_nope = call["q_nope"]
    lse_shape = (q_nope.shape[0], q_nope.shape[1]) if call.get("return_lse", False) else (0,)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(lse_shape, dtype=torch.float32)


# astr::append_kv and astr::append_mla have Meta kernels in C++ (csrc/ops/registration.cpp),
# which fake tensors run: each checks the arguments as the device kernels do, and writes nothing.


# astr::check_trace_state returns nothing and exists for its check: dead-code elimination in
# torch.fx (dynamo, AOTAutograd, inductor) must keep it. Its C++ kernel is a no-op on fake and
# meta tensors, so it needs no fake kernel.
torch.fx.node.has_side_effect(torch.ops.astr.check_trace_state.default)


def append_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    k_cache: torch.Tensor,  # [P, S, Hkv, D], written in place
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv], written in place
    slot_mapping: torch.Tensor,  # int32 [T], page * S + offset; negative skips the token
    k_scale: Optional[torch.Tensor] = None,  # FP8 pools: float32 [Hkv], quantized on write
    v_scale: Optional[torch.Tensor] = None,
) -> None:
    torch.ops.astr.append_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def append_mla(
    ckv: torch.Tensor,  # [T, Dc] the new tokens' latents
    krope: torch.Tensor,  # [T, Dr] their rotary keys (rope applied)
    ckv_cache: torch.Tensor,  # [P, S, Dc], written in place
    krope_cache: torch.Tensor,  # [P, S, Dr], written in place
    slot_mapping: torch.Tensor,  # int32 [T], page * S + offset; negative skips the token
    ckv_scale: Optional[torch.Tensor] = None,  # FP8 (e4m3) latent pool: float32 [1]
) -> None:
    torch.ops.astr.append_mla(ckv, krope, ckv_cache, krope_cache, slot_mapping, ckv_scale)


def set_kernel_tuning(tuning: str) -> None:
    """The cuda backend's kernel tuning, e.g. "decode_form=persistent,persistent_blocks=3"
    ("" = automatic); csrc/kernels/paged_attention/plan.h documents the keys."""
    torch.ops.astr.set_kernel_tuning(tuning)


def set_metadata_checks(enabled: bool) -> None:
    """Checked mode: validate paged metadata on every call (a host synchronisation)."""
    torch.ops.astr.set_metadata_checks(enabled)


# The Python side's copy of the batch-invariant switch (the C++ one is the truth), which the API
# reads on every paged call so that torch.compile guards on it: the torch_native backend is
# decomposed when a graph is traced, so a graph traced in one mode must not run in the other. A
# module global, not a class attribute: dynamo guards a module's globals in every supported torch,
# while some versions read a class attribute's constant without a guard.
# ASTR_BATCH_INVARIANT is read here, at load (a value that is no switch raises, naming it).
batch_invariant_enabled: bool = bool(torch.ops.astr.batch_invariant())


def set_batch_invariant(enabled: bool) -> None:
    """Batch-invariant mode: every paged call's output rows (and lse) for a sequence are the
    same bits whatever the batch around it (the other sequences, its position, the batch size),
    for decode, verify and prefill, on the cuda and torch_native backends, eagerly and under
    CUDA-graph replay. Off by default (``ASTR_BATCH_INVARIANT=1`` turns it on at load); what it
    costs: README.md, "Serving engines". Process-wide. Compiled code through
    ``astrai.attention`` recompiles when it changes (not direct ``torch.ops.astr`` calls)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled: expected True or False, got {enabled!r}")
    global batch_invariant_enabled
    torch.ops.astr.set_batch_invariant(enabled)
    batch_invariant_enabled = enabled


def batch_invariant() -> bool:
    """Whether batch-invariant mode is on (``set_batch_invariant``)."""
    return bool(torch.ops.astr.batch_invariant())


def backend_status(name: str) -> dict:
    return json.loads(torch.ops.astr.backend_status(name))


def set_backend_status(name: str, available: bool, reason: str, version: int = 0) -> None:
    torch.ops.astr.set_backend_status(name, available, reason, version)
