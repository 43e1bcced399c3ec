"""Fixtures shared by the kernel tests."""

import pytest
import torch

from astrai.extension import ops  # loads the library, registers the ops


def cuda_op(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start_loc,
    max_query_len,
    decode,
    attn_mask=None,
    is_causal=True,
    scale=None,
    window_left=-1,
    softcap=None,
    sinks=None,
    return_lse=False,
    k_scale=None,
    v_scale=None,
    tree_mask=None,
    topk_indices=None,
):
    """astr::cuda_paged_attention (the cuda backend's op, over attention's arguments) for a
    paged call, positionally in the order the kernel tests build their calls; (out, lse)."""
    return torch.ops.astr.cuda_paged_attention(
        q,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=max_query_len,
        mode="decode" if decode else "prefill",
        window_left=window_left,
        softcap=softcap or None,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
        tree_mask=tree_mask,
        topk_indices=topk_indices,
        return_lse=return_lse,
    )


def batch_cuda_op(batch, q, *args, **kwargs):
    """cuda_op over ``batch``'s pools and step metadata (test_cuda_kernels.PagedBatch, or an
    Fp8Batch over one) for queries q; the other arguments are cuda_op's from max_query_len on."""
    return cuda_op(
        q,
        batch.k_cache,
        batch.v_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        *args,
        **kwargs,
    )


def captured_graph(step):
    """A CUDA graph of one call of ``step`` and what that call returned (the static outputs a
    replay refills). ``step`` runs once on a side stream first, as capture requires, so that
    its workspace is allocated before the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.fixture
def tuning():
    """Sets the kernel tuning for one test (a comma-separated string, see plan.h), automatic
    again afterwards; tuning.add(...) adds to what is set (a fixture's kernel, say)."""
    current = []

    def set_tuning(*parts):
        current[:] = [p for p in parts if p]
        ops.set_kernel_tuning(",".join(current))

    set_tuning.add = lambda *parts: set_tuning(*current, *parts)
    yield set_tuning
    ops.set_kernel_tuning("")


# The prefill kernels the tests run, each forced by the kernel tuning where it runs (elsewhere the
# plan's choice runs again): the warp-specialised wgmma kernel (an sm_90 GPU, a library built for
# sm_90a, a head dim that compiles it: config.h) copying K/V by TMA boxes where the pool allows it
# (pages of 8 slots or more) and by its cp.async gather, the first wgmma kernel and mma.sync; and
# the persistent form of the warp-specialised kernel (opt-in until measured): one block per SM
# with claimed items, and grids of 3 and 2 blocks, so that every block takes many items one after
# another (claimed and gathering; round robin by boxes).
PREFILL_KERNEL_TUNINGS = {
    "warp_specialized": "prefill_kernel=warp_specialized",
    "warp_specialized_gather": "prefill_kernel=warp_specialized,prefill_loads=cp_async",
    "wgmma": "prefill_kernel=wgmma",
    "mma_sync": "prefill_kernel=mma_sync",
    "persistent": "prefill_kernel=persistent",
    "persistent_3_blocks_gather": (
        "prefill_kernel=persistent,persistent_blocks=3,prefill_loads=cp_async"
    ),
    "persistent_2_blocks_round_robin": (
        "prefill_kernel=persistent,persistent_blocks=2,prefill_schedule=round_robin"
    ),
}


@pytest.fixture(params=list(PREFILL_KERNEL_TUNINGS))
def prefill_kernel(request, tuning):
    """Runs a prefill test on every prefill kernel (PREFILL_KERNEL_TUNINGS)."""
    tuning(PREFILL_KERNEL_TUNINGS[request.param])
    return request.param
