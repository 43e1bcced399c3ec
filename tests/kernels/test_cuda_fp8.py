"""GPU tests of the cuda backend over FP8 KV caches (float8_e4m3fn and float8_e5m2 pools with
float32 per-kv-head scales; q in bf16 or fp16).

The reference is float64 attention over the dequantized stored bytes (stored.float() * scale):
the values the kernels read. Pools hold NaN in every slot no sequence owns, outputs are poisoned
first, and a control shows the comparison fails if the scales were ignored.
"""

import math

import pytest
import torch

from tests.kernels.conftest import captured_graph
from tests.kernels.test_cuda_kernels import (
    HEAD_DIMS,
    MERGE_TUNING,
    UNEQUAL_HEAD_DIMS,
    PagedBatch,
    splits_tuning,
)
from tests.kernels.test_cuda_variants import run as run_variant
from tests.kernels.test_cuda_variants import variant_reference
from tests.reference import quantize

# Skipped where no GPU is visible (tests/conftest.py).
pytestmark = pytest.mark.cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# How an FP8 prefill runs (plan.h): on pages the binding dequantizes first, or reading the bytes
# itself (the wgmma prefill, D = 128 on sm_90, and the mma.sync prefill; the warp-specialised one
# reads dequantized pages only). Each tuning forces the kernel (a preference: where it does not
# run, the automatic choice) and the way.
PREFILL_WAYS = {
    "warp_specialized": "prefill_kernel=warp_specialized,fp8_prefill=dequantize_first",
    "persistent": "prefill_kernel=persistent,fp8_prefill=dequantize_first",
    "wgmma_in_kernel": "prefill_kernel=wgmma,fp8_prefill=in_kernel",
    "wgmma_dequantized": "prefill_kernel=wgmma,fp8_prefill=dequantize_first",
    "mma_sync_in_kernel": "prefill_kernel=mma_sync,fp8_prefill=in_kernel",
    "mma_sync_dequantized": "prefill_kernel=mma_sync,fp8_prefill=dequantize_first",
}


class Fp8Batch:
    """A PagedBatch whose pools are quantized to `fp8` with random per-head scales, which the
    reference applies as the kernels do (stored.float() * scale)."""

    def __init__(self, batch: PagedBatch, fp8, generator):
        self.inner = batch
        hkv = batch.k_cache.shape[2]
        self.k_scale = (torch.rand(hkv, generator=generator, device="cuda") + 0.25).float()
        self.v_scale = (torch.rand(hkv, generator=generator, device="cuda") + 0.25).float()
        # NaN (unowned slots) stays NaN: a read of one shows up.
        self.k_cache = quantize(batch.k_cache, self.k_scale, fp8)
        self.v_cache = quantize(batch.v_cache, self.v_scale, fp8)
        for name in (
            "block_table",
            "seq_lens",
            "query_start_loc",
            "q",
            "seq_lens_list",
            "q_lens_list",
            "page_size",
            "num_tokens",
        ):
            setattr(self, name, getattr(batch, name))


def run(
    batch,
    decode,
    scales=True,
    window_left=-1,
    softcap=0.0,
    sinks=None,
    return_lse=False,
    scale=None,
):
    return run_variant(
        batch,
        batch.q,
        decode,
        scale if scale is not None else 1.0 / math.sqrt(batch.q.shape[-1]),
        window_left,
        softcap,
        sinks,
        return_lse=return_lse,
        k_scale=batch.k_scale if scales else None,
        v_scale=batch.v_scale if scales else None,
    )


def assert_matches(out, ref):
    assert not torch.isnan(out).any(), "output has NaN (unwritten element or read of a NaN slot)"
    err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 1e-2, f"relative L2 error {err:.3e}"
    return err


def unscaled_reference(batch, ref_scale=1.0):
    """The same attention over the stored bytes without their scales: the control."""
    saved = batch.k_scale, batch.v_scale
    batch.k_scale, batch.v_scale = torch.ones_like(saved[0]), torch.ones_like(saved[1])
    try:
        return variant_reference(batch, batch.q, 1.0 / math.sqrt(batch.q.shape[-1]))[0]
    finally:
        batch.k_scale, batch.v_scale = saved


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size,group", [(1, 4), (16, 1), (16, 8), (128, 4)])
def test_fp8_decode_matches_reference(fp8, q_dtype, head_dim, page_size, group):
    g = torch.Generator(device="cuda").manual_seed(100 + head_dim + page_size + group)
    lens = [1, 129, 2000, int(torch.randint(2, 3000, (1,), generator=g, device="cuda"))]
    inner = PagedBatch(lens, [1] * 4, 2 * group, 2, head_dim, page_size, q_dtype, generator=g)
    batch = Fp8Batch(inner, fp8, g)
    out, _ = run(batch, True)
    ref, _ = variant_reference(batch, batch.q, 1.0 / math.sqrt(head_dim))
    assert_matches(out, ref)
    control = unscaled_reference(batch)
    assert (out.double() - control).norm() / control.norm() > 0.05


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("magnitude", [3e4, 1e-6])
def test_fp8_decode_of_a_query_outside_f16s_range_matches_reference(fp8, magnitude):
    """An FP8 decode multiplies in f16 (tile_math.cuh); a bf16 query is brought into f16's range
    by a power of two first (query_tile_to_f16): one of magnitude 3e4 (largest values past f16's
    65504) or 1e-6 (below f16's normals) gives the reference's answer, its scale set so that the
    scores stay of order one."""
    g = torch.Generator(device="cuda").manual_seed(1234)
    inner = PagedBatch([1, 300, 2000, 777], [1] * 4, 8, 2, 128, 16, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, fp8, g)
    batch.q = (batch.q.float() * magnitude).to(torch.bfloat16)
    if magnitude > 1:
        assert batch.q.float().abs().max() > 65504  # beyond f16 without the power of two
    scale = 1.0 / (math.sqrt(128) * magnitude)
    out, _ = run(batch, True, scale=scale)
    ref, _ = variant_reference(batch, batch.q, scale)
    assert_matches(out, ref)
    control = unscaled_reference(batch)  # the bytes without their scales, at the default scale
    assert (out.double() - control).norm() / control.norm() > 0.05


@pytest.mark.parametrize(
    "splits,merge",
    [
        (None, "auto"),
        (1, "auto"),
        (1, "eight"),
        (1, "persistent"),
        (2, "pairs"),
        (2, "cluster"),
        (2, "kernel"),
        (7, "auto"),
    ],
)
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_decode_in_every_form_with_the_variants(splits, merge, fp8, tuning):
    """Every decode form (the persistent one falls back: it reads 16-bit caches only), with a
    window, a softcap, sinks and the lse."""
    tuning(splits_tuning(splits), MERGE_TUNING[merge])
    g = torch.Generator(device="cuda").manual_seed(41 + (splits or 0))
    lens = [1, 300, 5000, 129, 2222]
    inner = PagedBatch(lens, [1] * 5, 32, 8, 128, 16, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, fp8, g)
    sinks = (torch.randn(32, generator=g, device="cuda") * 2).float()
    scale = 1.0 / math.sqrt(128)
    out, lse = run(batch, True, window_left=1000, softcap=20.0, sinks=sinks, return_lse=True)
    ref, ref_lse = variant_reference(batch, batch.q, scale, 1000, 20.0, sinks)
    assert_matches(out, ref)
    assert (lse.double() - ref_lse).abs().max() < 2e-2


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("way", PREFILL_WAYS)
def test_fp8_prefill_with_cached_prefixes_matches_reference(fp8, head_dim, page_size, way, tuning):
    tuning(PREFILL_WAYS[way])
    g = torch.Generator(device="cuda").manual_seed(200 + head_dim + page_size)
    q_lens = [300, 1, 77]
    lens = [1300, 40, 77]
    inner = PagedBatch(lens, q_lens, 8, 2, head_dim, page_size, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, fp8, g)
    out, _ = run(batch, False)
    ref, _ = variant_reference(batch, batch.q, 1.0 / math.sqrt(head_dim))
    assert_matches(out, ref)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("way", PREFILL_WAYS)
def test_fp8_prefill_with_the_variants_matches_reference(fp8, q_dtype, way, tuning):
    """Every prefill kernel over an FP8 cache, with a window, a softcap, sinks and the lse, in
    both q dtypes (the wgmma kernel reading the bytes multiplies in f16 whatever q's dtype); a
    control shows the scales matter."""
    tuning(PREFILL_WAYS[way])
    g = torch.Generator(device="cuda").manual_seed(300 + len(way))
    inner = PagedBatch([1300, 40, 500], [300, 1, 211], 16, 4, 128, 16, q_dtype, generator=g)
    batch = Fp8Batch(inner, fp8, g)
    sinks = (torch.randn(16, generator=g, device="cuda") * 2).float()
    scale = 1.0 / math.sqrt(128)
    out, lse = run(batch, False, window_left=700, softcap=30.0, sinks=sinks, return_lse=True)
    ref, ref_lse = variant_reference(batch, batch.q, scale, 700, 30.0, sinks)
    assert_matches(out, ref)
    assert (lse.double() - ref_lse).abs().max() < 2e-2
    plain, _ = run(batch, False)
    control = unscaled_reference(batch)
    assert (plain.double() - control).norm() / control.norm() > 0.05


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("magnitude", [3e4, 1e-6])
@pytest.mark.parametrize("way", PREFILL_WAYS)
def test_fp8_prefill_of_a_query_outside_f16s_range_matches_reference(fp8, magnitude, way, tuning):
    """The wgmma prefill over an FP8 cache multiplies in f16: a bf16 query of magnitude 3e4
    (beyond f16's 65504) or 1e-6 (below f16's normals) is brought into f16's range by a power of
    two per block (query_tile_to_f16) and gives the reference's answer."""
    tuning(PREFILL_WAYS[way])
    g = torch.Generator(device="cuda").manual_seed(4321)
    inner = PagedBatch([900, 77], [400, 77], 8, 2, 128, 16, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, fp8, g)
    batch.q = (batch.q.float() * magnitude).to(torch.bfloat16)
    if magnitude > 1:
        assert batch.q.float().abs().max() > 65504
    scale = 1.0 / (math.sqrt(128) * magnitude)
    out, _ = run(batch, False, scale=scale)
    ref, _ = variant_reference(batch, batch.q, scale)
    assert_matches(out, ref)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the wgmma and warp-specialised prefills: an sm_90 GPU",
)
@pytest.mark.parametrize(
    "head_dim,padded_width,way,kernel,expect_pass",
    [
        # 514 pages: 0.13 GiB of scratch at D = 128, dequantized first (the warp-specialised
        # kernel on 16-bit pages)
        (128, 0, "auto", "paged_prefill_warp_specialized_kernel", True),
        # padded to 1714 pages: 0.42 GiB, the wgmma kernel reads the bytes
        (128, 1200, "auto", "paged_prefill_wgmma_kernel", False),
        (128, 0, "in_kernel", "paged_prefill_wgmma_kernel", False),
        (128, 1200, "dequantize_first", "paged_prefill_warp_specialized_kernel", True),
        # D = 96: dequantized first, the warp-specialised kernel; the bytes, the mma.sync one
        (96, 0, "auto", "paged_prefill_warp_specialized_kernel", True),
        (96, 0, "in_kernel", "paged_prefill_kernel", False),
        # D = 64: the warp-specialised kernel on dequantized pages, beyond the limit (padded to
        # 4214 pages: 0.51 GiB) the mma.sync kernel reading the bytes
        (64, 0, "auto", "paged_prefill_warp_specialized_kernel", True),
        (64, 3700, "auto", "paged_prefill_kernel", False),
    ],
)
def test_fp8_prefill_dequantizes_first_only_within_the_scratch_limit(
    head_dim, padded_width, way, kernel, expect_pass, tuning
):
    """On the H200 a prefill reads the FP8 pages itself once the dequantized pages would take
    more than plan.h's 256 MiB (num_seqs x block-table width pages of bf16, K and V): then no
    dequantizing pass runs and no such scratch is allocated. Below it, and when forced, the pass
    runs and the scratch shows in the peak memory (the control)."""
    from tests.kernels.test_cuda_kernels import launched_kernel_names

    tuning(f"fp8_prefill={way}")
    g = torch.Generator(device="cuda").manual_seed(77)
    lens = [8192, 4000, 6000, 100]
    inner = PagedBatch(lens, [64] * 4, 32, 8, head_dim, 16, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, torch.float8_e4m3fn, g)
    ref, _ = variant_reference(batch, batch.q, 1.0 / math.sqrt(head_dim))
    if padded_width:  # columns past every length: never read
        pad = torch.full((4, padded_width), 3, dtype=torch.int32, device="cuda")
        batch.block_table = torch.cat([batch.block_table, pad], dim=1)
    width = batch.block_table.shape[1]
    scratch = 2 * 4 * width * 16 * 8 * head_dim * 2  # K and V, bf16
    assert (scratch > 256 << 20) == (padded_width > 0)
    names = launched_kernel_names(lambda: run(batch, False))
    attention = [n for n in names if "paged_prefill" in n]
    assert attention and all(kernel + "<" in n for n in attention), attention
    assert any("dequantize_pages_kernel" in n for n in names) == expect_pass, names
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out, _ = run(batch, False)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert (extra >= scratch) == expect_pass, (extra, scratch)
    assert_matches(out, ref)


@pytest.mark.parametrize("way", PREFILL_WAYS)
def test_fp8_prefill_with_an_empty_block_table_does_what_a_16_bit_cache_does(way, tuning):
    """A block table of width 0 (no page to read, the lengths past it): every way of reading an
    FP8 cache returns what the same call over the 16-bit cache returns (the plan must not take an
    FP8 call with no scratch to dequantize for a 16-bit one), NaN where that is NaN."""
    tuning(PREFILL_WAYS[way])
    g = torch.Generator(device="cuda").manual_seed(31)
    inner = PagedBatch([40, 7], [40, 7], 8, 2, 96, 16, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, torch.float8_e4m3fn, g)
    empty = torch.zeros(2, 0, dtype=torch.int32, device="cuda")
    batch.block_table = inner.block_table = empty
    out, _ = run(batch, False)
    expected, _ = run_variant(inner, inner.q, False, 1.0 / math.sqrt(96), -1, 0.0, None)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))


def test_fp8_prefill_with_a_bad_page_id_poisons_only_its_sequence():
    g = torch.Generator(device="cuda").manual_seed(5)
    inner = PagedBatch([700, 900], [50, 30], 8, 2, 128, 16, torch.bfloat16, generator=g)
    batch = Fp8Batch(inner, torch.float8_e4m3fn, g)
    batch.block_table = batch.block_table.clone()
    batch.block_table[1, 2] = -4
    out, _ = run(batch, False)
    assert torch.isnan(out[50:]).all()
    ref, _ = variant_reference(batch, batch.q, 1.0 / math.sqrt(128))
    assert_matches(out[:50], ref[:50])


def test_fp8_decode_under_cuda_graph_replay_with_growing_lengths():
    g = torch.Generator(device="cuda").manual_seed(9)
    inner = PagedBatch([4096] * 4, [1] * 4, 32, 8, 128, 16, torch.bfloat16, generator=g)
    inner.k_cache.copy_(torch.randn(inner.k_cache.shape, generator=g, device="cuda"))
    inner.v_cache.copy_(torch.randn(inner.v_cache.shape, generator=g, device="cuda"))
    batch = Fp8Batch(inner, torch.float8_e4m3fn, g)
    batch.seq_lens = torch.tensor([3, 1, 17, 100], dtype=torch.int32, device="cuda")
    static_q = batch.q.clone()
    batch.q = static_q
    graph, (static_out, _) = captured_graph(lambda: run(batch, True))
    for lens in ([3, 1, 17, 100], [64, 600, 700, 1000], [2048, 129, 4000, 4096]):
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        static_q.copy_(torch.randn(static_q.shape, generator=g, device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        batch.seq_lens_list = lens
        ref, _ = variant_reference(batch, static_q, 1.0 / math.sqrt(128))
        assert_matches(static_out, ref)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,dv", [(64, 64), (192, 128)], ids=["64", "192v128"])
def test_fp8_append_stores_the_values_torch_would(fp8, dtype, d, dv):
    g = torch.Generator(device="cuda").manual_seed(13)
    pool = torch.zeros(8, 16, 4, d, dtype=fp8, device="cuda")
    v_pool = torch.zeros(8, 16, 4, dv, dtype=fp8, device="cuda")
    k = torch.randn(20, 4, d, generator=g, device="cuda").to(dtype) * 50
    v = torch.randn(20, 4, dv, generator=g, device="cuda").to(dtype)
    k[3, 0, :3] = torch.tensor([1e6, -1e6, float("nan")])
    k_scale = torch.rand(4, generator=g, device="cuda") + 0.1
    v_scale = torch.rand(4, generator=g, device="cuda") + 0.1
    slots = torch.randperm(128, generator=g, device="cuda")[:20].int()
    slots[5] = -1  # skipped
    torch.ops.astr.append_kv(k, v, pool, v_pool, slots, k_scale, v_scale)
    keep = slots >= 0
    expect_k = quantize(k, k_scale, fp8)[keep]
    expect_v = quantize(v, v_scale, fp8)[keep]
    got_k = pool.view(-1, 4, d)[slots[keep].long()]
    got_v = v_pool.view(-1, 4, dv)[slots[keep].long()]
    assert torch.equal(got_k.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), expect_v.view(torch.uint8))


def test_fp8_decode_step_through_the_api_under_torch_compile():
    import astrai.extension as ae

    cache = ae.PagedKVCache(2, 256, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(1, 700, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    for layer in range(2):
        cache.scales_from(layer, k, k)
    cache.begin_step([0, 1], [300, 400])
    q = torch.randn(1, 700, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    for layer in range(2):
        ae.attention(q, k, k, kv_cache=cache, layer_id=layer, fwd="prefill", is_causal=True)
    cache.begin_step([0, 1], [1, 1])
    q1 = torch.randn(1, 2, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    k1 = torch.randn(1, 2, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v):
        return ae.attention(q, k, v, kv_cache=cache, layer_id=1, fwd="decode", is_causal=True)

    eager = ae.attention(
        q1, k1, k1, kv_cache=cache, layer_id=1, fwd="decode", is_causal=True, backend="torch_native"
    )
    compiled = torch.compile(step, fullgraph=True)(q1, k1, k1)
    assert ae.explain(q1, kv_cache=cache, layer_id=1, fwd="decode", is_causal=True).backend == (
        "cuda"
    )
    err = (compiled.double() - eager.double()).norm() / eager.double().norm()
    assert err < 1e-2


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("head_dims", UNEQUAL_HEAD_DIMS)
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("way", ["mma_sync_in_kernel", "mma_sync_dequantized"])
def test_fp8_unequal_head_dims_match_reference(fp8, head_dims, decode, way, tuning):
    """q/k 192 and v 128 over an FP8 cache: the decode dequantizes in registers, the prefill reads
    the bytes whatever the tuning asks (the dequantizing pass takes one head dim: plan.h)."""
    tuning(PREFILL_WAYS[way])
    d, dv = head_dims
    g = torch.Generator(device="cuda").manual_seed(300 + d + dv + decode)
    q_lens = [1, 1, 1] if decode else [300, 1, 77]
    lens = [1300, 40, 777]
    inner = PagedBatch(lens, q_lens, 8, 2, d, 16, torch.bfloat16, generator=g, head_dim_v=dv)
    batch = Fp8Batch(inner, fp8, g)
    out, _ = run(batch, decode)
    assert out.shape[-1] == dv
    ref, _ = variant_reference(batch, batch.q, 1.0 / math.sqrt(d))
    assert_matches(out, ref)
    control = unscaled_reference(batch)
    assert (out.double() - control).norm() / control.norm() > 0.05
