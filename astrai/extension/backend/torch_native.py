"""torch_native: composite C++ over at::scaled_dot_product_attention; every device, every
dtype SDPA takes, differentiable. Always available."""

from .builtin import BuiltinBackend


class TorchNativeBackend(BuiltinBackend):
    name = "torch_native"

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def status_reason(cls) -> str:
        return "at::scaled_dot_product_attention (scores written out for the variants)"
