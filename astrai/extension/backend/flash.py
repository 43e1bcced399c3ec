"""flash: the flash-attn package's kernels behind the same op. The package is looked for lazily
(on first use); an import error becomes the reason shown by ``info`` and ``explain``."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import List

import torch

from .. import ops
from . import flash_ops
from .builtin import BuiltinBackend


@dataclass(frozen=True)
class FlashProbe:
    available: bool
    version: int = 0  # FlashAttention major version: 2, 3 or 4
    module: str = ""
    reason: str = ""
    tried: List[str] = field(default_factory=list)


def _gpu_arch() -> int:
    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


# (module, FlashAttention version, the functions astrai calls), most capable first. FlashAttention-4
# (flash_attn.cute: CUTLASS DSL kernels for sm_90 and newer) has no flash_attn_with_kvcache; its
# paged path is flash_attn_varlen_func(page_table=...).
_CANDIDATES = (
    ("flash_attn_interface", 3, ("flash_attn_func", "flash_attn_with_kvcache")),
    ("flash_attn.cute", 4, ("flash_attn_func", "flash_attn_varlen_func")),
    ("flash_attn", 2, ("flash_attn_func", "flash_attn_with_kvcache")),
)


def _needs_another_gpu(version: int, arch: int) -> str:
    """Why this GPU should use another installed package ("" if it need not). Only what picks
    between packages: the resolver checks every call's arch (FlashAttention-2's sm_80 too)."""
    if version == 3 and arch != 90:
        return f"FlashAttention-3 needs sm_90 (GPU is sm_{arch})"
    if version == 4 and arch and arch < 90:
        return f"FlashAttention-4 needs sm_90 or newer (GPU is sm_{arch})"
    return ""


def _release(module) -> str:
    release = getattr(module, "__version__", None)
    if release and release != "0.0.0":
        return release
    try:  # flash_attn.cute reports 0.0.0 unless its distribution is named "fa4"
        from importlib.metadata import version

        return version("flash-attn-4")
    except Exception:
        return release or "?"


@functools.cache
def probe_flash() -> FlashProbe:
    """Import flash-attn once, tell the C++ resolver what was found, and return it."""
    tried = []
    found = None
    for name, version, api in _CANDIDATES:
        try:
            module = importlib.import_module(name)
        except Exception as error:  # a broken install must not break astrai's import
            tried.append(f"{name}: {type(error).__name__}: {error}".splitlines()[0][:200])
            continue
        missing = [function for function in api if not hasattr(module, function)]
        if missing:
            tried.append(f"{name}: imported, but has no {', '.join(missing)}")
            continue
        unsuitable = _needs_another_gpu(version, _gpu_arch())
        if unsuitable:
            tried.append(f"{name}: {unsuitable}")
            continue
        if version == 4:
            flash_ops.register_flash4(module)
        else:
            flash_ops.register(module)
        found = (name, version, _release(module))
        break
    if found is None:
        reason = "flash-attn not importable (" + "; ".join(tried) + ")"
        probe = FlashProbe(False, reason=reason, tried=tried)
    else:
        name, version, release = found
        probe = FlashProbe(
            True,
            version=version,
            module=name,
            reason=f"FlashAttention-{version} from {name} {release}",
            tried=tried,
        )
    ops.set_backend_status("flash", probe.available, probe.reason, probe.version)
    return probe


class FlashAttnBackend(BuiltinBackend):
    name = "flash"

    @classmethod
    def available(cls) -> bool:
        return probe_flash().available

    @classmethod
    def status_reason(cls) -> str:
        return probe_flash().reason

    def _forward_dense(self, q, k, v, attn_mask=None, is_causal=False, scale=None):
        if attn_mask is not None:
            raise ValueError(
                "FlashAttnBackend cannot apply a custom attention mask (only is_causal); "
                "use the torch_native backend for masked calls"
            )
        return self._attention(q, k, v, None, 0, None, is_causal, None, scale)
