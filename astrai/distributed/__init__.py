"""astrai over torch.distributed: context-parallel paged attention (context_parallel.py)."""

from .context_parallel import (
    ContextParallelCache,
    ContextParallelMismatchError,
    ContextParallelStep,
    owner_rank,
)

__all__ = [
    "ContextParallelCache",
    "ContextParallelMismatchError",
    "ContextParallelStep",
    "owner_rank",
]
