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
_REBUILD = "rebuild it with: pip install --no-build-isolation --force-reinstall --no-deps ."


def _load_library() -> dict:
    candidates = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "_C*.so")))
    if not candidates:
        raise ImportError(f"astrai: native library astrai/_C*.so not found; {_REBUILD}")
    try:
        torch.ops.load_library(candidates[0])
    except OSError as error:
        raise ImportError(
            f"astrai: could not load {candidates[0]} ({error}); it was probably built against "
            f"another torch than {torch.__version__}; {_REBUILD}"
        ) from error
    info = json.loads(torch.ops.astr.build_info())
    if info["torch_version"] != torch.__version__:
        raise ImportError(
            f"astrai: the native library was built against torch {info['torch_version']} but "
            f"torch {torch.__version__} is installed; {_REBUILD}"
        )
    return info


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


def backend_status(name: str) -> dict:
    return json.loads(torch.ops.astr.backend_status(name))


def set_backend_status(name: str, available: bool, reason: str, version: int = 0) -> None:
    torch.ops.astr.set_backend_status(name, available, reason, version)
