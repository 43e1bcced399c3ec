"""Context parallelism: one sequence's KV cache split over the ranks of a process group, every
rank attending over its share and the shares merged exactly. Here one gloo rank, so that it runs
anywhere; under ``torchrun --nproc-per-node N`` each rank holds every N-th page.

    python examples/context_parallel.py
    torchrun --nproc-per-node 2 examples/context_parallel.py   # two ranks (gloo)

Every rank gets the same q/k/v and returns the same output; the result equals single-device
attention over the whole sequence (checked here against a plain PagedKVCache).
"""

import os
import tempfile

import torch
import torch.distributed as dist

import astrai
from astrai.distributed import ContextParallelCache

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5

if "WORLD_SIZE" in os.environ:  # launched by torchrun
    dist.init_process_group("gloo")
else:  # one rank, rendezvous through a file
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # the same inputs on every rank
heads, kv_heads, head_dim, prompt = 8, 2, 64, 70
shape = dict(num_pages=32, page_size=16, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
distributed = ContextParallelCache(1, device=device, **shape)
single = astrai.PagedKVCache(1, device=device, **shape)


def step(counts, fwd):
    tokens = sum(counts)
    q = torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, tokens, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(1, tokens, kv_heads, head_dim, device=device, dtype=dtype)
    distributed.begin_step([0], counts)
    single.begin_step([0], counts)
    if fwd == "decode":
        q, k, v = (t.view(len(counts), 1, *t.shape[2:]) for t in (q, k, v))
    out = distributed.attention(q, k, v, layer_id=0)
    want = astrai.attention(q, k, v, kv_cache=single, layer_id=0, is_causal=True, fwd=fwd)
    return (out.double() - want.double()).abs().max().item()


errors = [step([prompt], "prefill")] + [step([1], "decode") for _ in range(5)]
if rank == 0:
    print(
        f"{world} rank(s), sequence of {distributed.seq_len(0)} tokens: max |context-parallel "
        f"- single device| = {max(errors):.1e}"
    )
assert max(errors) < tolerance
dist.destroy_process_group()
