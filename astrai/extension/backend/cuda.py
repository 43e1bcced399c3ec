"""cuda: astrai's own paged-KV-cache kernels (csrc/kernels), for KV-cache prefill and decode."""

import functools

import torch

from .. import ops
from .builtin import BuiltinBackend


@functools.cache
def cuda_kernels_available() -> bool:
    if not ops.backend_status("cuda")["available"] or not torch.cuda.is_available():
        return False
    return any(
        torch.cuda.get_device_capability(i) >= (8, 0) for i in range(torch.cuda.device_count())
    )


def cuda_unavailable_reason() -> str:
    status = ops.backend_status("cuda")
    if not status["available"]:
        return status["reason"]
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    if not cuda_kernels_available():
        return "no GPU of sm_80 or newer"
    return ""


class CudaBackend(BuiltinBackend):
    name = "cuda"

    @classmethod
    def available(cls) -> bool:
        return cuda_kernels_available()

    @classmethod
    def status_reason(cls) -> str:
        return cuda_unavailable_reason() or ops.backend_status("cuda")["reason"]
