"""flash: the flash-attn package's kernels behind the same op. The package is looked for lazily
(on first use); an import error becomes the reason shown by ``info`` and ``explain``."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import List

import torch

from .. import ops
from .builtin import BuiltinBackend
from .call import run_builtin


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


# (module, FlashAttention version, the op its package registers with the dispatcher)
_CANDIDATES = (
    ("flash_attn_interface", 3, "flash_attn_3::fwd"),
    ("flash_attn.cute", 4, "flash_attn_cute::fwd"),
    ("flash_attn", 2, "flash_attn::_flash_attn_forward"),
)


def _op_registered(qualified: str) -> bool:
    namespace, name = qualified.split("::")
    return hasattr(getattr(torch.ops, namespace), name)


@functools.lru_cache(maxsize=None)
def probe_flash() -> FlashProbe:
    """Import flash-attn once, tell the C++ resolver what was found, and return it."""
    tried = []
    found = None
    for module, version, op in _CANDIDATES:
        try:
            importlib.import_module(module)
        except Exception as error:  # a broken install must not break astrai's import
            tried.append(f"{module}: {type(error).__name__}: {error}".splitlines()[0][:200])
            continue
        if not _op_registered(op):
            tried.append(f"{module}: imported, but registers no torch op {op}")
            continue
        arch = _gpu_arch()
        if version == 3 and arch != 90:
            tried.append(f"{module}: FlashAttention-3 needs sm_90 (GPU is sm_{arch})")
            continue
        found = (module, version)
        break
    if found is None:
        reason = "flash-attn not importable (" + "; ".join(tried) + ")"
        probe = FlashProbe(False, reason=reason, tried=tried)
    else:
        module, version = found
        probe = FlashProbe(True, version=version, module=module,
                           reason=f"FlashAttention-{version} from {module}", tried=tried)
    ops.set_backend_status("flash", probe.available, probe.reason, probe.version)
    return probe


class FlashAttnBackend(BuiltinBackend):
    name = "flash"

    @classmethod
    def available(cls) -> bool:
        return probe_flash().available

    def _forward_dense(self, q, k, v, attn_mask=None, is_causal=False, scale=None):
        if attn_mask is not None:
            raise ValueError(
                "FlashAttnBackend cannot apply a custom attention mask (only is_causal); "
                "use the torch_native backend for masked calls"
            )
        return run_builtin(q, k, v, None, 0, None, is_causal, None, self.name, scale)
