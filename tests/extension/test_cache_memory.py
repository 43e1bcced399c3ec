"""A decode loop run without torch.no_grad() (as README's loop is) keeps its memory flat: the
cache stores k/v as values and never an autograd graph (issue 47, defect 1: every step used to
link the pools to the previous step's graph, and memory grew by about 12 KB a step).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from astrai.extension import PagedKVCache, attention

STEPS, WARMUP = 10_000, 1_000
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 16
TOKENS_PER_SEQUENCE = 48  # then the sequence is freed and the next one starts


@pytest.fixture
def one_cpu_thread():
    """Tiny CPU ops on one thread: on a shared machine, OpenMP's threads waiting for each other
    make each step a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_ten_thousand_decode_steps_without_no_grad_keep_memory_flat(device, one_cpu_thread):
    torch.manual_seed(0)
    # q, k and v projections whose parameters require grad, as a model's do.
    projection = torch.nn.Linear(64, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device)
    cache = PagedKVCache(1, 8, 16, KV_HEADS, HEAD_DIM, dtype=torch.float32, device=device)
    seq_id, length = 0, 0
    for step in range(STEPS):
        if step == WARMUP:
            gc.collect()
            host_before = resident_bytes()
            device_before = torch.cuda.memory_allocated() if device == "cuda" else 0
        if length == TOKENS_PER_SEQUENCE:
            cache.free(seq_id)
            seq_id, length = seq_id + 1, 0
        cache.begin_step([seq_id], [1])
        length += 1
        qkv = projection(torch.randn(1, 64, device=device)).view(1, 1, -1, HEAD_DIM)
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=2)
        out = attention(q, k, v, kv_cache=cache, fwd="decode")
        assert out.requires_grad  # the loop does run with autograd on
    gc.collect()
    host_after = resident_bytes()
    assert host_after <= 1.05 * host_before, (host_before, host_after)
    if device == "cuda":
        device_after = torch.cuda.memory_allocated()
        assert device_after <= 1.05 * device_before + (64 << 10), (device_before, device_after)
